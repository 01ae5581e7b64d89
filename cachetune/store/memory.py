"""CPU-RAM (or GPU-memory) tier: chunks kept as tensors, least recently used evicted past a byte budget.

Safe to use from several threads: one lock guards the index and the byte count, so the budget holds
at every moment (a chunk is admitted only after enough older ones are out; one chunk larger than the
whole budget is kept alone)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.config import MEMORY_TIER_BYTES
from cachetune.store.base import ChunkStore, StoredChunk


class MemoryChunk(StoredChunk):
    def __init__(self, chunk: EncodedChunk, device: torch.device | None):
        self.chunk_id = chunk.chunk_id
        self.token_ids = chunk.token_ids
        self.ranking = chunk.ranking
        self.scores = chunk.scores
        self.ranker = chunk.ranker
        self.positions = chunk.positions
        self.variant = chunk.variant
        self.keys = chunk.keys if device is None else chunk.keys.to(device)
        self.values = chunk.values if device is None else chunk.values.to(device)

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    def encoded(self) -> EncodedChunk:
        return EncodedChunk(self.chunk_id, self.token_ids, self.keys.cpu(), self.values.cpu(), self.ranking,
                            self.scores, self.ranker, self.positions, self.variant)

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = indices.to(self.keys.device)
        return self.keys[layer].index_select(0, idx), self.values[layer].index_select(0, idx)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class MemoryStore(ChunkStore):
    """In-process tier holding at most `max_bytes` of K/V (default config.MEMORY_TIER_BYTES); a chunk
    alone over the budget is kept alone. `device` puts chunks on e.g. a GPU."""

    def __init__(self, max_bytes: int = MEMORY_TIER_BYTES, device: str | torch.device | None = None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.device = torch.device(device) if device is not None else None
        self._chunks: OrderedDict[str, MemoryChunk] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """K/V bytes held now."""
        return self._bytes

    def put(self, chunk: EncodedChunk) -> None:
        with self._lock:
            if chunk.chunk_id in self._chunks:
                self._chunks.move_to_end(chunk.chunk_id)
                return
        stored = MemoryChunk(chunk, self.device)  # the copy to a device runs outside the lock
        evicted = []
        with self._lock:
            if chunk.chunk_id in self._chunks:  # another thread put it meanwhile
                return
            while self._chunks and self._bytes + stored.nbytes > self.max_bytes:
                evicted.append(self._chunks.popitem(last=False)[1])
                self._bytes -= evicted[-1].nbytes
            self._chunks[chunk.chunk_id] = stored
            self._bytes += stored.nbytes
        for old in evicted if self.on_evict is not None else ():
            self.on_evict(old)

    def get(self, chunk_id: str) -> MemoryChunk | None:
        with self._lock:
            stored = self._chunks.get(chunk_id)
            if stored is not None:
                self._chunks.move_to_end(chunk_id)
            return stored

    def remove(self, chunk_id: str) -> None:
        with self._lock:
            stored = self._chunks.pop(chunk_id, None)
            if stored is not None:
                self._bytes -= stored.nbytes

    def __len__(self) -> int:
        return len(self._chunks)
