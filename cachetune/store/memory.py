"""CPU-RAM (or GPU-memory) tier: chunks kept as tensors, least recently used evicted past a byte budget."""

from __future__ import annotations

from collections import OrderedDict

import torch

from cachetune.chunks.encode import EncodedChunk
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

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = indices.to(self.keys.device)
        return self.keys[layer].index_select(0, idx), self.values[layer].index_select(0, idx)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class MemoryStore(ChunkStore):
    """In-process tier. `max_bytes=None` keeps everything; `device` pins chunks to e.g. a GPU."""

    def __init__(self, max_bytes: int | None = None, device: str | torch.device | None = None):
        self.max_bytes = max_bytes
        self.device = torch.device(device) if device is not None else None
        self._chunks: OrderedDict[str, MemoryChunk] = OrderedDict()
        self._bytes = 0

    def put(self, chunk: EncodedChunk) -> None:
        if chunk.chunk_id in self._chunks:
            self._chunks.move_to_end(chunk.chunk_id)
            return
        stored = MemoryChunk(chunk, self.device)
        self._chunks[chunk.chunk_id] = stored
        self._bytes += stored.nbytes
        while self.max_bytes is not None and self._bytes > self.max_bytes and len(self._chunks) > 1:
            _, evicted = self._chunks.popitem(last=False)
            self._bytes -= evicted.nbytes

    def get(self, chunk_id: str) -> MemoryChunk | None:
        stored = self._chunks.get(chunk_id)
        if stored is not None:
            self._chunks.move_to_end(chunk_id)
        return stored

    def remove(self, chunk_id: str) -> None:
        stored = self._chunks.pop(chunk_id, None)
        if stored is not None:
            self._bytes -= stored.nbytes

    def __len__(self) -> int:
        return len(self._chunks)
