"""Redis (or Valkey) tier: one chunk cache shared by many processes and machines.

Each chunk is one value, the chunk blob (store.blob) under `<prefix>:<fingerprint>:<chunk id>`, written
once with SET NX (ids are content addresses). A process reads a chunk whole, and verifies it, the
first time it sees it; after that only rank ranges are read: one pipelined GETRANGE per chunk per
layer (`RedisReader`), keys and values together, each widened to block boundaries and verified by the
block sums held since that first read (store.blob, range verification): a value overwritten in part,
or replaced by another chunk's, fails there. The byte budget and LRU are the server's own
(`maxmemory` with `maxmemory-policy allkeys-lru`); a value the server evicted is a miss.

Redis failing is never a request failing:
- unreachable (at start, or killed): `get` answers a miss and `put` skips, so the engine recomputes;
  a warning is logged once per outage and `errors` counts the failed calls; for `RETRY_S` after a
  failure the tier is not tried at all (requests do not wait on a dead server), then it reconnects;
- a read that fails mid-request, or comes back short (evicted meanwhile), raises
  TierUnavailableError (a CorruptChunkError), on which the engine reads its chunks again;
- a range that fails its block sums (the value changed since it was verified) raises
  CorruptChunkError and counts in `errors`; the handle is dropped, so the engine's second lookup reads
  the whole value again, which deletes it when it is bad (the chunk is re-encoded) and adopts it when
  another process rewrote a valid copy.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.lru import LRUDict
from cachetune.store.base import ChunkStore, CorruptChunkError
from cachetune.store.blob import BlobChunk, BlobMeta, ModelShape, check_id, pack, pack_scores, verify, verify_scores
from cachetune.store.disk import byte_view

log = logging.getLogger(__name__)

RETRY_S = 1.0      # after a failure, how long the tier answers misses without trying the server
TIMEOUT_S = 2.0    # socket timeout of every call (a hung server costs a request at most this)


class TierUnavailableError(CorruptChunkError):
    """A shared tier could not serve a chunk it had (down, or the value evicted): read it again."""


def _redis():
    try:
        import redis
    except ImportError as exc:  # a clear error rather than a failure at the first request
        raise RuntimeError("the redis tier needs the `redis` package (pip install redis)") from exc
    return redis


class RedisChunk(BlobChunk):
    """A verified chunk on the server, read by rank ranges."""

    def __init__(self, store: "RedisStore", key: str, meta: BlobMeta):
        super().__init__(meta)
        self.store, self.key, self.reader = store, key, store.reader

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ranks = self.rank_of[indices.cpu()]
        lo, hi = (int(ranks.min()), int(ranks.max()) + 1) if ranks.numel() else (0, 0)
        lay = self.layout
        out = torch.empty(hi - lo, 2, lay.kv_heads, lay.head_dim, dtype=lay.dtype)
        self.reader.plan([(self, lo, hi)])(layer, out)
        kv = out.index_select(0, ranks - lo)
        return kv[:, 0], kv[:, 1]

    def encoded(self) -> EncodedChunk:
        """The whole chunk in one GET, verified again (what promotion to a faster tier copies)."""
        blob = self.store.call(lambda r: r.get(self.key), mid_request=True)
        if blob is None:
            raise TierUnavailableError(f"chunk {self.chunk_id} left the redis tier")
        meta = verify(blob, self.store.fingerprint, self.chunk_id, self.store.shape)
        lay = meta.layout
        kv = torch.frombuffer(bytearray(blob[lay.kv_start: lay.kv_start + lay.layers * lay.rows * lay.row_bytes]),
                              dtype=lay.dtype).view(lay.layers, lay.rows, 2, lay.kv_heads, lay.head_dim)
        kv = kv.index_select(1, self.rank_of)  # ranking order -> local order
        return EncodedChunk(self.chunk_id, meta.token_ids, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous(),
                            meta.ranking, meta.scores, meta.ranker, meta.positions, meta.variant)


class RedisReader:
    """runtime.loading.RangeReader of one server: per layer, one pipelined round trip of GETRANGEs."""

    device = torch.device("cpu")
    blocking = True

    def __init__(self, store: "RedisStore"):
        self.store = store
        self.bytes_read = 0

    def plan(self, spans):
        def read(layer: int, out: torch.Tensor) -> None:
            ranges = []  # (chunk, offset, length of the covering blocks, first row of them, lo, hi)
            for chunk, lo, hi in spans:
                a, b = chunk.layout.covering(lo, hi)
                ranges.append((chunk, *chunk.layout.span(layer, a, b), a, lo, hi))

            def fetch(r):
                pipe = r.pipeline(transaction=False)
                for chunk, offset, length, *_ in ranges:
                    pipe.getrange(chunk.key, offset, offset + length - 1)
                return pipe.execute()

            values = self.store.call(fetch, mid_request=True)
            view, at, fetched = byte_view(out), 0, 0
            for (chunk, _, length, a, lo, hi), value in zip(ranges, values):
                lay = chunk.layout
                if len(value) != length:  # the server evicted (or lost) the value since it was verified
                    self.store.forget(chunk.key)
                    raise TierUnavailableError(f"redis value {chunk.key} is gone or short "
                                               f"({len(value)} of {length} bytes)")
                try:
                    lay.check(layer, a, a + length // lay.row_bytes, [value])
                except CorruptChunkError as exc:
                    self.store.bad_range(chunk.key, exc)
                    raise CorruptChunkError(f"redis value {chunk.key}: {exc}") from None
                want = (hi - lo) * lay.row_bytes
                skip = (lo - a) * lay.row_bytes
                view[at: at + want] = memoryview(value)[skip: skip + want]
                at += want
                fetched += length
            self.bytes_read += fetched

        return read


class RedisStore(ChunkStore):
    """Chunks of one model (`fingerprint`, `shape` checked on every value) on the server at `url`.

    `max_open` verified handles are kept per process; `errors` counts calls that failed and ranges
    that failed their block sums."""

    shared = True
    kind = "redis"

    def __init__(self, url: str, fingerprint: str, shape: ModelShape | None = None, prefix: str = "cachetune",
                 max_open: int = 4096):
        redis = _redis()
        self.url, self.fingerprint, self.shape = url, fingerprint, shape
        self.namespace = f"{prefix}:{fingerprint[:16]}"
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                           retry=None, retry_on_timeout=False)
        self.reader = RedisReader(self)
        self.errors = 0
        self._down_until = 0.0
        self._warned = False
        self._verified: LRUDict[str, RedisChunk] = LRUDict(max_open)
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """False while the tier is backing off after a failure."""
        return time.monotonic() >= self._down_until

    def call(self, fn, mid_request: bool = False):
        """fn(client), or: None (a miss) when the server cannot be reached, TierUnavailableError
        instead when a request is already reading from it (`mid_request`)."""
        if not self.available:
            if mid_request:
                raise TierUnavailableError(f"redis tier {self.url} is unavailable")
            return None
        try:
            result = fn(self.client)
        except self._errors as exc:
            with self._lock:
                self.errors += 1
                self._down_until = time.monotonic() + RETRY_S
                warn, self._warned = not self._warned, True
            if warn:
                log.warning("redis tier %s unavailable (%s): chunks are recomputed until it returns", self.url, exc)
            if mid_request:
                raise TierUnavailableError(f"redis tier {self.url}: {exc}") from None
            return None
        if self._warned:
            with self._lock:
                self._warned = False
            log.warning("redis tier %s is back", self.url)
        return result

    def key(self, chunk_id: str) -> str:
        return f"{self.namespace}:{check_id(chunk_id)}"

    def forget(self, key: str) -> None:
        self._verified.pop(key.rsplit(":", 1)[-1], None)

    def bad_range(self, key: str, exc: CorruptChunkError) -> None:
        """A range of a verified value failed its block sums: count it and drop the handle (the next
        `get` reads and verifies the whole value again, deleting it if it is bad)."""
        with self._lock:
            self.errors += 1
        self.forget(key)
        log.warning("redis value %s: %s; dropped its verified handle", key, exc)

    def put(self, chunk: EncodedChunk) -> None:
        key = self.key(chunk.chunk_id)
        if self._verified.get(chunk.chunk_id) is not None:
            return
        blob = pack(chunk, self.fingerprint)
        self.call(lambda r: r.set(key, blob, nx=True))

    def get(self, chunk_id: str) -> RedisChunk | None:
        key = self.key(chunk_id)
        cached = self._verified.get(chunk_id)
        if cached is not None:
            present = self.call(lambda r: r.exists(key))
            if present:
                self.hits += 1
                return self.tag(cached)
            self._verified.pop(chunk_id, None)  # evicted by the server, or the server is down
            return None
        blob = self.call(lambda r: r.get(key))
        if blob is None:
            return None
        try:
            meta = verify(blob, self.fingerprint, chunk_id, self.shape)
        except CorruptChunkError as exc:
            self.call(lambda r: r.delete(key))
            raise CorruptChunkError(f"redis value {key}: {exc}") from None
        stored = RedisChunk(self, key, meta)
        self._verified.put(chunk_id, stored)
        self.hits += 1
        return self.tag(stored)

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None:
        key, blob = self.key(chunk_id), pack_scores(chunk_id, ranker, scores, self.fingerprint)
        self.call(lambda r: r.hset(f"{key}:scores", ranker, blob) if r.exists(key) else None)

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None:
        stored = self.get(chunk_id)
        key = f"{self.key(chunk_id)}:scores"
        blob = self.call(lambda r: r.hget(key, ranker)) if stored is not None else None
        if blob is None:
            return None
        try:
            return verify_scores(blob, self.fingerprint, chunk_id, ranker, int(stored.ranking.numel()))
        except CorruptChunkError as exc:
            log.warning("dropped bad scores %s[%s]: %s", key, ranker, exc)
            self.call(lambda r: r.hdel(key, ranker))
            return None

    def remove(self, chunk_id: str) -> None:
        key = self.key(chunk_id)
        self._verified.pop(chunk_id, None)
        self.call(lambda r: r.delete(key, f"{key}:scores"))

    def __len__(self) -> int:
        keys = self.call(lambda r: sum(1 for k in r.scan_iter(match=f"{self.namespace}:*", count=1000)
                                        if not k.endswith(b":scores")))
        return keys or 0
