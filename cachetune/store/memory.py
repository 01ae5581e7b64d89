"""CPU-RAM (pinned on CUDA machines) or GPU-memory tier: every chunk's rows in one preallocated arena.

The arena holds `[L, capacity, 2, Hkv, D]` rows, capacity = the byte budget over the bytes of one row
across layers, allocated on the first put (untouched pages of a CPU arena cost nothing). A chunk gets
any free rows, in ranking order (a block manager whose blocks are one row), so the rows a request
reuses from all its chunks are one gather per layer (`ArenaReader`). Least recently used chunks are
evicted to make room; an evicted chunk's rows return to the free list only when the last handle to
it is gone, so a request still reading a chunk never sees its rows overwritten. A chunk larger than
the whole tier is not kept (a tiered store hands it to the next tier).

Safe to use from several threads: one lock guards the index, the free list and the byte count."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.config import MEMORY_TIER_BYTES
from cachetune.store.base import ChunkStore, StoredChunk


class RowArena:
    """Preallocated K/V rows [L, capacity, 2, Hkv, D] handed out row by row."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int,
                 device: torch.device, pinned: bool):
        self.kv = torch.empty(layers, capacity, 2, kv_heads, head_dim, dtype=dtype, device=device,
                              pin_memory=pinned)
        self.shape = (layers, kv_heads, head_dim, dtype)
        self.capacity = capacity
        self.row_bytes = layers * 2 * kv_heads * head_dim * dtype.itemsize  # one row across all layers
        self._free = torch.arange(capacity - 1, -1, -1)  # a stack of free rows; the top is the end
        self._top = capacity
        self._released: deque[torch.Tensor] = deque()    # rows of dead handles (appended from finalizers)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free rows [n] (on the arena's device), or None; the caller holds the store lock."""
        while self._released:
            rows = self._released.popleft().cpu()
            self._free[self._top: self._top + rows.numel()] = rows
            self._top += rows.numel()
        if n > self._top:
            return None
        self._top -= n
        return self._free[self._top: self._top + n].to(self.kv.device, copy=True)  # not a view of the stack

    def release(self, rows: torch.Tensor) -> None:
        """Return rows (thread-safe without the lock: a finalizer may run anywhere)."""
        self._released.append(rows)


class ArenaReader:
    """runtime.loading.RangeReader of one arena: one gather per layer for all planned chunks."""

    blocking = False  # a memcpy on the host, or a kernel on the GPU

    def __init__(self, arena: RowArena):
        self.arena, self.device = arena, arena.kv.device
        self.bytes_read = 0

    def plan(self, spans):
        index = torch.cat([chunk.rows_at[lo:hi] for chunk, lo, hi in spans])

        def read(layer: int, out: torch.Tensor) -> None:
            torch.index_select(self.arena.kv[layer], 0, index, out=out)
            self.bytes_read += out.nbytes

        return read


class MemoryChunk(StoredChunk):
    """A chunk in an arena: `rows_at` [R] is the arena row of each rank."""

    def __init__(self, chunk: EncodedChunk, arena: RowArena, rows_at: torch.Tensor, reader: ArenaReader):
        self.take_metadata(chunk)
        self.arena, self.rows_at, self.reader = arena, rows_at, reader
        self.more_scores: dict[str, torch.Tensor] = {}  # other rankers' scores (put_scores)
        weakref.finalize(self, arena.release, rows_at)  # its rows are free once no request holds it

    @property
    def num_layers(self) -> int:
        return int(self.arena.kv.shape[0])

    @property
    def row_dtype(self) -> torch.dtype:
        return self.arena.kv.dtype

    @property
    def nbytes(self) -> int:
        return int(self.rows_at.numel()) * self.arena.row_bytes

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.arena.kv[layer].index_select(0, self.rows_at[self.rank_of[indices.cpu()].to(self.rows_at.device)])
        self.reader.bytes_read += kv.nbytes
        return kv[:, 0], kv[:, 1]

    def encoded(self) -> EncodedChunk:
        kv = self.arena.kv[:, self.rows_at[self.rank_of.to(self.rows_at.device)]].cpu()  # [L, R, 2, Hkv, D] local order
        return EncodedChunk(self.chunk_id, self.token_ids, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous(),
                            self.ranking, self.scores, self.ranker, self.positions, self.variant)


class MemoryStore(ChunkStore):
    """In-process tier holding at most `max_bytes` of K/V (default config.MEMORY_TIER_BYTES).
    `device` puts the arena on e.g. a GPU; `pinned` pins a CPU arena (fast, async copies to a GPU)."""

    def __init__(self, max_bytes: int = MEMORY_TIER_BYTES, device: str | torch.device | None = None,
                 pinned: bool = False):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pinned = pinned
        self.kind = "gpu" if self.device.type == "cuda" else "cpu"
        self._arena: RowArena | None = None
        self.reader: ArenaReader | None = None
        self._chunks: OrderedDict[str, MemoryChunk] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """K/V bytes held by the chunks in this tier now."""
        return self._bytes

    def _arena_for(self, chunk: EncodedChunk) -> RowArena:
        layers, _, kv_heads, head_dim = chunk.keys.shape
        shape = (int(layers), int(kv_heads), int(head_dim), chunk.keys.dtype)
        if self._arena is None:
            row_bytes = 2 * shape[0] * shape[1] * shape[2] * shape[3].itemsize
            self._arena = RowArena(*shape, capacity=self.max_bytes // row_bytes, device=self.device,
                                   pinned=self.pinned)
            self.reader = ArenaReader(self._arena)
        if self._arena.shape != shape:
            raise ValueError(f"chunk K/V {shape} do not match this tier's {self._arena.shape}")
        return self._arena

    def put(self, chunk: EncodedChunk) -> None:
        rows = int(chunk.ranking.numel())
        evicted: list[MemoryChunk] = []
        with self._lock:
            if chunk.chunk_id in self._chunks:
                self._chunks.move_to_end(chunk.chunk_id)
                return
            arena = self._arena_for(chunk)
            if rows > arena.capacity:
                return  # larger than the whole tier
            while self._chunks and self._bytes + rows * arena.row_bytes > arena.capacity * arena.row_bytes:
                evicted.append(self._chunks.popitem(last=False)[1])
                self._bytes -= evicted[-1].nbytes
        if self.on_evict is not None:
            for old in evicted:
                self.on_evict(old)  # demote while its rows are still intact
            old = None
        evicted.clear()  # the last handles: their rows return to the free list unless a request holds them
        data = torch.stack([chunk.keys, chunk.values], dim=2).index_select(1, chunk.ranking.to(torch.int64))
        data = data.to(self.device)
        with self._lock:
            if chunk.chunk_id in self._chunks:  # another thread put it meanwhile
                return
            rows_at = arena.alloc(rows)
            if rows_at is None:
                return  # rows still held by requests reading evicted chunks: not kept this time
            arena.kv.index_copy_(1, rows_at, data)
            stored = MemoryChunk(chunk, arena, rows_at, self.reader)
            self._chunks[chunk.chunk_id] = stored
            self._bytes += stored.nbytes

    def get(self, chunk_id: str) -> MemoryChunk | None:
        with self._lock:
            stored = self._chunks.get(chunk_id)
            if stored is not None:
                self._chunks.move_to_end(chunk_id)
                self.hits += 1
                self.tag(stored)
            return stored

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None:
        stored = self.get(chunk_id)
        if stored is not None:
            stored.more_scores[ranker] = scores

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None:
        stored = self.get(chunk_id)
        return stored.more_scores.get(ranker) if stored is not None else None

    def remove(self, chunk_id: str) -> None:
        with self._lock:
            stored = self._chunks.pop(chunk_id, None)
            if stored is not None:
                self._bytes -= stored.nbytes

    def __len__(self) -> int:
        return len(self._chunks)
