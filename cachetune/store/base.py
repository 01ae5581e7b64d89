"""The chunk store contract: where encoded chunks live between requests (one tier per implementation)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.errors import CachetuneError


class CorruptChunkError(CachetuneError, RuntimeError):
    """A stored chunk failed its integrity or model check; it has been dropped from the store."""


class StoredChunk(ABC):
    """A handle to one stored chunk. Metadata is in memory; K/V are loaded per layer on demand."""

    chunk_id: str
    token_ids: torch.Tensor  # [N]
    ranking: torch.Tensor    # [N] local indices, most worth recomputing first
    scores: torch.Tensor     # [N] float32 behind the ranking (global budgets compare them across chunks)
    ranker: str              # the offline ranker that produced them (cachetune.chunks.rankers)
    positions: torch.Tensor | None = None  # [R] local positions of compressed rows; None: row i is token i
    variant: str = ""        # what made the rows ("" plain chunk encoding; see chunks.encode.chunk_id)
    tier: str = ""           # label of the tier whose lookup returned it (ChunkStore.label; "" outside a store)

    reader = None            # runtime.loading.RangeReader of this tier (None: load_layer per chunk)

    def take_metadata(self, source) -> None:
        """Copy id, tokens, ranking, scores, ranker, positions and variant from `source` (an
        EncodedChunk, a verified blob's BlobMeta, another StoredChunk)."""
        for name in ("chunk_id", "token_ids", "ranking", "scores", "ranker", "positions", "variant"):
            setattr(self, name, getattr(source, name))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def rank_of(self) -> torch.Tensor:
        """[R] the rank of every local row (the inverse of `ranking`)."""
        if getattr(self, "_rank_of", None) is None:
            rank_of = torch.empty_like(self.ranking)
            rank_of[self.ranking] = torch.arange(self.ranking.numel())
            self._rank_of = rank_of
        return self._rank_of

    @property
    def row_positions(self) -> torch.Tensor:
        """[R] the local position of every stored row (arange(N) for a plain chunk)."""
        return self.positions if self.positions is not None else torch.arange(self.num_tokens)

    @abstractmethod
    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values [len(indices), Hkv, D] of `layer` for local row `indices`
        (token indices of a plain chunk).

        Only the requested rows are read from the tier: this is how the reuse complement is loaded
        without touching the tokens that will be recomputed anyway.
        """

    def encoded(self) -> EncodedChunk:
        """The whole chunk (every row of every layer, local order): what moves between tiers."""
        every = torch.arange(int(self.ranking.numel()))
        pairs = [self.load_layer(layer, every) for layer in range(self.num_layers)]
        return EncodedChunk(self.chunk_id, self.token_ids, torch.stack([k for k, _ in pairs]),
                            torch.stack([v for _, v in pairs]), self.ranking, self.scores, self.ranker,
                            self.positions, self.variant)

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def row_dtype(self) -> torch.dtype:
        """dtype of the stored K/V rows."""


class LocalChunk(StoredChunk):
    """An encoded chunk used as is, outside any store (when no tier could take it)."""

    def __init__(self, chunk: EncodedChunk):
        self.chunk = chunk
        self.take_metadata(chunk)

    @property
    def num_layers(self) -> int:
        return int(self.chunk.keys.shape[0])

    @property
    def row_dtype(self) -> torch.dtype:
        return self.chunk.keys.dtype

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chunk.keys[layer][indices], self.chunk.values[layer][indices]

    def encoded(self) -> EncodedChunk:
        return self.chunk


class TierStats(NamedTuple):
    """Counters of one tier since the store opened (what the server's /metrics reports per tier)."""

    tier: str        # its kind: gpu, cpu, disk, redis
    hits: int        # lookups it answered
    bytes_read: int  # K/V bytes read from it
    errors: int      # calls that failed (an unreachable server), range reads that failed their block sums


class ChunkStore(ABC):
    """Maps chunk ids to stored chunks for one model.

    Contract: `get` returns None for an unknown id and raises CorruptChunkError (after removing the
    entry) for one that fails its checks, so a caller can re-encode; it never returns data it could
    not verify. `put` of an id already present is a no-op (ids are content addresses). A store with a
    byte budget calls `on_evict(stored)` (when set, outside its lock) for every chunk it evicts, before
    the chunk's data is gone: how a tiered store demotes. `shared` stores (disk, Redis) are seen by
    other processes.
    """

    shared: bool = False
    on_evict: Callable[[StoredChunk], None] | None = None
    kind: str = "store"  # the tier kind stats() reports
    label: str = ""      # what names this tier in a calibration (config.TierSpec.label; "": its kind)
    hits: int = 0        # gets that found the chunk
    errors: int = 0
    reader = None        # the tier's RangeReader (it counts bytes_read)

    def stats(self) -> list[TierStats]:
        """One entry per tier, fastest first (a single store is one tier)."""
        return [TierStats(self.kind, self.hits, getattr(self.reader, "bytes_read", 0), self.errors)]

    def tag(self, stored: StoredChunk) -> StoredChunk:
        """`stored`, marked as read from this tier (what ratio="auto" looks up)."""
        stored.tier = self.label or self.kind
        return stored

    def put_evicted(self, stored: StoredChunk) -> None:
        """Take a chunk another tier evicted (a no-op when it is already here)."""
        try:
            present = self.get(stored.chunk_id) is not None
        except CorruptChunkError:
            present = False
        if not present:
            self.put(stored.encoded())

    @abstractmethod
    def put(self, chunk: EncodedChunk) -> None: ...

    @abstractmethod
    def get(self, chunk_id: str) -> StoredChunk | None: ...

    @abstractmethod
    def remove(self, chunk_id: str) -> None: ...

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None:
        """Keep another ranker's scores [R] of a chunk this tier holds, so no process computes them
        again (ignored for a chunk it does not hold; removed with the chunk)."""

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None:
        """Scores kept by put_scores, or None (absent, or failed their check and were dropped)."""
        return None

    def __contains__(self, chunk_id: str) -> bool:
        try:
            return self.get(chunk_id) is not None
        except CorruptChunkError:
            return False
