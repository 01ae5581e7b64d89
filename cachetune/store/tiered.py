"""A chunk store as a chain of tiers, fastest first (GPU memory, CPU RAM, disk, a shared server).

    store = TieredStore([MemoryStore(4 * GiB), DiskStore(root, fingerprint, max_bytes=100 * GiB)])

- `put` stores in the fastest tier that can hold the chunk and writes through to every shared tier
  (`tier.shared`: disk, Redis), so another process finds the chunk at once.
- A tier that evicts past its byte budget hands the chunk to the next tier (demotion); the last one
  drops it.
- `get` answers from the fastest tier holding the chunk; a hit in a slower tier is copied into the
  fastest one (promotion), so the next request reads it from there.
- A corrupt entry in any tier is dropped there and reported as CorruptChunkError (never used); the
  caller re-encodes.
Safe to use from several threads (one lock orders moves between tiers; reads of rows need none).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pathlib import Path

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.config import TierSpec
from cachetune.store.base import ChunkStore, CorruptChunkError, StoredChunk, TierStats
from cachetune.store.blob import ModelShape
from cachetune.store.disk import DiskStore
from cachetune.store.memory import MemoryStore
from cachetune.store.redis import RedisStore
from cachetune.store.throttled import Medium, ThrottledStore


class TieredStore(ChunkStore):
    def __init__(self, tiers: Sequence[ChunkStore]):
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self._lock = threading.RLock()
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            upper.on_evict = lower.put_evicted  # demotion
        self.hits = [0] * len(self.tiers)  # gets answered by each tier
        self.misses = 0

    def put(self, chunk: EncodedChunk) -> None:
        with self._lock:
            kept = False  # by a tier so far (a chunk larger than a tier goes on to the next)
            for tier in self.tiers:
                if not kept or tier.shared:
                    tier.put(chunk)
                    kept = kept or chunk.chunk_id in tier

    def get(self, chunk_id: str) -> StoredChunk | None:
        with self._lock:
            corrupt: CorruptChunkError | None = None
            for level, tier in enumerate(self.tiers):
                try:
                    stored = tier.get(chunk_id)
                except CorruptChunkError as exc:  # dropped there; a slower tier may still hold it intact
                    corrupt = exc
                    continue
                if stored is None:
                    continue
                self.hits[level] += 1
                if level > 0:
                    self.tiers[0].put(stored.encoded())
                    stored = self.tiers[0].get(chunk_id) or stored
                return stored
            self.misses += 1
            if corrupt is not None:
                raise corrupt
            return None

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None:
        """Into the fastest tier and every shared one (as put), so other processes find them."""
        for level, tier in enumerate(self.tiers):
            if level == 0 or tier.shared:
                tier.put_scores(chunk_id, ranker, scores)

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None:
        for level, tier in enumerate(self.tiers):
            scores = tier.get_scores(chunk_id, ranker)
            if scores is not None:
                if level > 0:
                    self.tiers[0].put_scores(chunk_id, ranker, scores)
                return scores
        return None

    def remove(self, chunk_id: str) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.remove(chunk_id)

    def stats(self) -> list[TierStats]:
        """Per tier: the gets it answered for this chain (a promoted chunk's re-read not counted)."""
        return [TierStats(own.tier, hits, own.bytes_read, own.errors)
                for hits, own in zip(self.hits, (tier.stats()[0] for tier in self.tiers))]

    def __len__(self) -> int:
        return len(self.tiers[0])


def build_store(specs: Sequence[TierSpec], fingerprint: str, shape: ModelShape, device: torch.device,
                default_dir: Path) -> ChunkStore:
    """The store `specs` describe (config.parse_tiers) for one model; a single tier stands alone."""
    tiers: list[ChunkStore] = []
    for spec in specs:
        if spec.kind == "gpu":
            if device.type != "cuda":
                raise ValueError("a gpu tier needs the engine on a CUDA device")
            tier = MemoryStore(spec.max_bytes, device=device)
        elif spec.kind == "cpu":
            tier = MemoryStore(spec.max_bytes, pinned=device.type == "cuda")  # async copies to the GPU
        elif spec.kind == "disk":
            tier = DiskStore(spec.path or default_dir, fingerprint, shape=shape, max_bytes=spec.max_bytes)
        else:
            tier = RedisStore(spec.path, fingerprint, shape=shape)
        if spec.throttle:
            tier = ThrottledStore(tier, Medium.parse(spec.throttle))
        tier.label = spec.label(default_dir)
        tiers.append(tier)
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)
