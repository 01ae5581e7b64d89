"""The token-selector contract: which tokens of each reused chunk a request recomputes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from cachetune.chunks.rankers import Ranker
from cachetune.chunks.ranking import top_share
from cachetune.engine.forward import FuseFn
from cachetune.engine.layout import PromptLayout
from cachetune.model.adapter import ModelAdapter
from cachetune.store.base import StoredChunk


class RankingSource(Protocol):
    """Offline rankings by ranker name (None: the configured default); cachetune.Engine is one."""

    def ranker(self, spec: str | None = None) -> Ranker: ...

    def scores(self, chunk: StoredChunk, spec: str | None = None) -> torch.Tensor: ...


@dataclass
class SelectionRequest:
    """What a selector may look at: the assembled prompt, the model, and offline rankings.

    `rankings.scores(chunk, name)` is the chunk's score vector by a named offline ranker
    (cachetune.chunks.rankers); the engine computes it once per chunk and keeps it.
    """

    layout: PromptLayout
    adapter: ModelAdapter
    rankings: RankingSource

    @property
    def chunks(self) -> list[StoredChunk]:
        return [seg.chunk for _, seg in self.layout.chunk_segments]


class TokenSelector(ABC):
    """Chooses, per chunk, the local token indices to recompute in the new context.

    Contract: `select` returns one sorted, duplicate-free int64 tensor per chunk (prompt order),
    each index in [0, chunk.num_tokens). By default everything not returned is loaded from the store
    and reused; a selector with `drops_unselected` instead removes the other tokens from the prompt.
    `ratio` is the share of chunk tokens budgeted for recompute; a selector may ignore it (full
    reuse, EPIC) but never exceeds a chunk's length. Online selectors (CacheBlend, ProphetKV) run
    model computation inside `select`; it counts toward the request's time to first token.
    """

    name: str
    reads_ranking: bool = False    # reads an offline ranking (callers compute it before timing)
    uses_ratio: bool = True        # False: selects the same tokens whatever the ratio
    ranker: str | None = None      # which one (None: the engine's configured default)
    drops_unselected: bool = False

    @abstractmethod
    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]: ...

    def fusion(self, request: SelectionRequest, selections: list[torch.Tensor]) -> FuseFn | None:
        """Optional: how recomputed K/V are blended with the stored ones (CacheSlide); None = replace."""
        return None


def split_global_top(scores: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Top round(ratio * total) tokens over all chunks together, returned per chunk (sorted, local).

    scores: one [N_i] tensor per chunk. Online methods select one shared budget across the context, so
    a chunk the query cares about can take more than `ratio` of its own tokens.
    """
    flat = torch.cat([s.float().cpu() for s in scores])
    chosen = top_share(torch.sort(flat, descending=True, stable=True).indices, ratio)
    out, start = [], 0
    for s in scores:
        n = s.numel()
        mask = (chosen >= start) & (chosen < start + n)
        out.append(chosen[mask] - start)
        start += n
    return out
