"""Chunks by content address: encoded once, found in the store's tiers, re-encoded when lost.

    cache = ChunkCache(adapter, fingerprint, store, rankings, vocab_size, max_context, lock, ...)
    cid = cache.cache_tokens(ids)    # encode ids [N] alone, rank them, store them; returns the id
    stored = cache.chunk(cid)        # found, or re-encoded from the tokens this cache remembers

Contract:
- A chunk's id is chunk_id(fingerprint, token ids): the same tokens under the same model are one
  chunk, whoever cached them; caching a known chunk encodes nothing.
- `chunk(cid)` never answers with a corrupt entry: one that fails its check is dropped and, when the
  tokens of `cid` are remembered (the last `tracked` chunks cached here), encoded again.
- A chunk no tier could take (all full of chunks in use, a shared tier down) lives in a bounded
  fallback memory, so an outage costs one encoding per chunk, not one per request; it is offered to
  the tiers again on later use (at most once a second while they refuse).
- Every call holds `lock` (the engine's), so no chunk changes under a running step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import torch

from cachetune.chunks.encode import EncodedChunk, chunk_id, encode_chunk
from cachetune.chunks.probes import PROBE_PASSAGES, ProbeBank
from cachetune.chunks.rankers import RankingContext
from cachetune.chunks.rankings import ChunkRankings
from cachetune.engine.prompt import DEFAULT_SYSTEM, PromptTemplate
from cachetune.errors import RequestError
from cachetune.lru import LRUDict
from cachetune.model.adapter import ModelAdapter
from cachetune.store.base import ChunkStore, CorruptChunkError, LocalChunk, StoredChunk
from cachetune.store.memory import MemoryStore

log = logging.getLogger(__name__)

FALLBACK_RETRY_S = 1.0  # after the tiers refused a fallback chunk, none is offered again for this long


class ChunkCache:
    def __init__(self, adapter: ModelAdapter, fingerprint: str, store: ChunkStore, rankings: ChunkRankings,
                 vocab_size: int, max_context: int | None, lock: threading.RLock, tracked: int,
                 fallback_bytes: int):
        self.adapter = adapter
        self.fingerprint = fingerprint
        self.store = store
        self.rankings = rankings
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.lock = lock
        self.fallback = MemoryStore(fallback_bytes, pinned=adapter.device.type == "cuda")
        self.encoded = 0  # chunks run through the model here (a chunk found in the store is not)
        self._tokens: LRUDict[str, torch.Tensor] = LRUDict(tracked)  # to re-encode a lost chunk
        self._retry_at = 0.0

    def cache_tokens(self, token_ids: torch.Tensor | Sequence[int]) -> str:
        """Encode `token_ids` [N] on their own once, rank them and store them; returns the chunk id.
        The ids are used exactly as given; on any error nothing is left behind."""
        ids = self.checked_ids(token_ids)
        cid = chunk_id(self.fingerprint, ids)
        with self.lock:
            known = cid in self._tokens
            self._tokens.put(cid, ids)
            try:
                self.chunk(cid)  # found, or encoded now and stored (or kept in the fallback)
            except BaseException:
                if not known:
                    self._tokens.pop(cid)
                raise
        return cid

    def checked_ids(self, token_ids) -> torch.Tensor:
        """A chunk's ids as a 1-D int64 CPU tensor, or a clear error."""
        if not isinstance(token_ids, torch.Tensor):
            if not isinstance(token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise ValueError("token ids must be a 1-D integer tensor or a list of ints")
            token_ids = torch.tensor(token_ids, dtype=torch.int64)
        if token_ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {token_ids.dtype}")
        if token_ids.numel() == 0:
            raise ValueError("cannot cache an empty chunk")
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got values in [{lo}, {hi}]")
        if self.max_context is not None and token_ids.numel() > self.max_context:
            raise RequestError(f"chunk of {token_ids.numel()} tokens is longer than the model's context window "
                               f"({self.max_context} positions)")
        return token_ids.to(torch.int64).cpu()

    def chunk(self, cid: str) -> StoredChunk:
        """The stored chunk; a missing or corrupt one is encoded again when its tokens are remembered
        (KeyError otherwise)."""
        with self.lock:
            stored = self.find(cid)
            tokens = self._tokens.get(cid)
            if stored is None and tokens is not None:
                encoded = self._encode(tokens)
                self.store.put(encoded)
                stored = self._lookup(cid)
                if stored is None:  # no tier took it: keep it here rather than encode it per request
                    self.fallback.put(encoded)
                    stored = self.fallback.get(cid) or LocalChunk(encoded)
            if stored is None:
                raise KeyError(f"chunk {cid} is not in the store; cache its text with cache_chunk() first")
            return stored

    def find(self, cid: str) -> StoredChunk | None:
        """The stored chunk, or None when no tier nor the fallback holds it intact (nothing is encoded)."""
        with self.lock:
            return self._lookup(cid) or self._from_fallback(cid)

    def remove(self, cid: str) -> bool:
        """Forget a chunk in every tier (shared ones too) and its tokens; False when none held it.
        Requests already holding it keep their handle."""
        with self.lock:
            present = (self._lookup(cid) or self.fallback.get(cid)) is not None
            self.store.remove(cid)
            self.fallback.remove(cid)
            self._tokens.pop(cid)
            return present

    def _lookup(self, cid: str) -> StoredChunk | None:
        try:
            return self.store.get(cid)
        except CorruptChunkError as exc:
            log.warning("dropped corrupt chunk %s: %s", cid, exc)
            return None

    def _from_fallback(self, cid: str) -> StoredChunk | None:
        """A fallback chunk, offered to the tiers first; it leaves the fallback once one holds it."""
        kept = self.fallback.get(cid)
        now = time.monotonic()
        if kept is None or now < self._retry_at:
            return kept
        self.store.put(kept.encoded())
        stored = self._lookup(cid)
        if stored is None:
            self._retry_at = now + FALLBACK_RETRY_S  # a dead tier is not retried on every lookup
            return kept
        self.fallback.remove(cid)
        return stored

    def _encode(self, token_ids: torch.Tensor) -> EncodedChunk:
        self.encoded += 1
        ranker = self.rankings.ranker()
        context = self.rankings.context() if ranker.needs_model else None
        return encode_chunk(self.adapter, token_ids, self.fingerprint, ranker, context)


def ranking_context(adapter: ModelAdapter, template: PromptTemplate, bos_id: int | None) -> RankingContext:
    """Model and probe prefixes for rankers that run the model.

    Probe 0 is the prompt head a request puts before its documents (template start, default system
    prompt); probe i > 0 is that head followed by PROBE_PASSAGES[i-1] as a document."""
    head = template.segments(DEFAULT_SYSTEM, "")[0]
    passages = [torch.cat([head, template.document(p)]) for p in PROBE_PASSAGES]
    return RankingContext(adapter, ProbeBank(adapter, [head, *passages]), bos_id)
