"""Offline rankings of stored chunks by any named ranker: the stored one, or computed once and kept.

A chunk is stored with the scores of the configured ranker. A method that reads another ranking (an
analysis control, `cachetune:<ranking>`) gets it computed on first use and kept in a bounded LRU and
in the store beside the chunk (every shared tier too), so requests never pay for it and no other
process computes it again; a hybrid reuses the rankings of its parts.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from cachetune.chunks.rankers import ChunkView, FusionRanker, Ranker, RankingContext, get_ranker
from cachetune.chunks.ranking import rank_fusion, ranking_from_scores
from cachetune.lru import LRUDict
from cachetune.model.adapter import ModelAdapter


class ScoreStore(Protocol):
    """Where computed scores are kept beside their chunk (a `cachetune.store.ChunkStore`)."""

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None: ...

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None: ...


class RankedChunk(Protocol):
    """What ranking reads of a stored chunk (a `cachetune.store.StoredChunk`)."""

    chunk_id: str
    token_ids: torch.Tensor  # [N]
    ranking: torch.Tensor    # [N] by the stored ranker
    scores: torch.Tensor     # [N]
    ranker: str

    @property
    def num_tokens(self) -> int: ...

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class ChunkRankings:
    """Implements methods.base.RankingSource for one engine.

    `default`: the ranker stored with every chunk (spec None); `context`: builds the model and probe
    prefixes that model-running rankers need (called at most once, on first need)."""

    def __init__(self, adapter: ModelAdapter, default: str, alpha: float, context: Callable[[], RankingContext],
                 capacity: int = 4096, store: ScoreStore | None = None):
        self.adapter = adapter
        self.store = store  # where computed scores are kept with their chunk (None: only in this process)
        self.default = default
        self.alpha = alpha
        self._make_context = context
        self._context: RankingContext | None = None
        # Rankers by the spec a request named (bounded: every request may name another spelling)
        self._rankers: LRUDict[str | None, Ranker] = LRUDict(64)
        self._scores: LRUDict[tuple[str, str], torch.Tensor] = LRUDict(capacity)

    def ranker(self, spec: str | None = None) -> Ranker:
        """The offline ranker named `spec` (None: the default, stored with every chunk)."""
        ranker = self._rankers.get(spec)
        if ranker is None:
            ranker = get_ranker(spec or self.default, self.alpha)
            self._rankers.put(spec, ranker)
        return ranker

    def context(self) -> RankingContext:
        if self._context is None:
            self._context = self._make_context()
        return self._context

    def scores(self, chunk: RankedChunk, spec: str | None = None) -> torch.Tensor:
        """The chunk's offline scores [N] by a named ranker: the stored ones when the chunk was cached
        with that ranker, otherwise computed once and kept.

        Computing scores other than the stored ones reads every layer of the chunk from its tier (and
        a probe ranker runs the model); callers that time requests ask before the clock starts
        (Method.prepare)."""
        ranker = self.ranker(spec)
        if chunk.ranker == ranker.name:
            return chunk.scores
        key = (chunk.chunk_id, ranker.name)
        found = self._scores.get(key)
        if found is None and self.store is not None:
            found = self.store.get_scores(chunk.chunk_id, ranker.name)  # computed by any process before
        if found is not None:
            self._scores.put(key, found)
            return found
        if isinstance(ranker, FusionRanker):
            # A hybrid's parts are rankings in their own right: reuse (and keep) theirs.
            scores = rank_fusion([self.scores(chunk, part.name) for part in ranker.parts])
        else:
            every = torch.arange(chunk.num_tokens)
            layers = [chunk.load_layer(layer, every) for layer in range(self.adapter.num_layers)]
            keys = torch.stack([k for k, _ in layers])  # [L, N, Hkv, D]
            values = torch.stack([v for _, v in layers])
            context = self.context() if ranker.needs_model else None
            scores = ranker.scores(ChunkView(chunk.token_ids, keys, values, context))
        self._scores.put(key, scores)
        if self.store is not None:
            self.store.put_scores(chunk.chunk_id, ranker.name, scores)
        return scores

    def ranking(self, chunk: RankedChunk, spec: str | None = None) -> torch.Tensor:
        """Local token indices, most worth recomputing first, by a named ranker (see `scores`)."""
        if chunk.ranker == self.ranker(spec).name:
            return chunk.ranking
        return ranking_from_scores(self.scores(chunk, spec))
