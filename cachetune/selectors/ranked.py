"""Selectors that read an offline ranking: CacheTune, the analysis controls, and LF-only pruning."""

from __future__ import annotations

import torch

from cachetune.chunks.ranking import ranking_from_scores, top_share
from cachetune.selectors.base import SelectionRequest, TokenSelector, split_global_top


class RankedSelector(TokenSelector):
    """Recompute the top `ratio` of each chunk by a query-independent ranking stored with the chunk.

    The same chunk recomputes the same tokens wherever it is placed and whatever the question. A
    ranker whose scores compare across chunks (`global_budget`, the prototype's `lf_v0`) instead
    takes the top `ratio` of all chunk tokens together. `ranker` None: the engine's default.
    """

    reads_ranking = True

    def __init__(self, name: str = "cachetune", ranker: str | None = None, drops_unselected: bool = False):
        self.name, self.ranker, self.drops_unselected = name, ranker, drops_unselected

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        scores = [request.rankings.scores(chunk, self.ranker) for chunk in request.chunks]
        if request.rankings.ranker(self.ranker).global_budget:
            return split_global_top(scores, ratio)
        return [top_share(ranking_from_scores(s), ratio) for s in scores]


class FirstTokensSelector(TokenSelector):
    """EPIC (LegoLink): recompute the first `k` tokens of every chunk, whatever the ratio.

    A chunk encoded alone turns its first tokens into attention sinks; recomputing them in context
    removes the spurious sinks. k=16 as in the CacheTune paper's EPIC setting.
    """

    name = "epic"
    uses_ratio = False

    def __init__(self, k: int = 16):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.arange(min(self.k, chunk.num_tokens)) for chunk in request.chunks]


class FullReuseSelector(TokenSelector):
    """Full reuse (r = 0): every chunk token comes from the store; only uncached text is computed."""

    name = "full_reuse"
    uses_ratio = False

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.empty(0, dtype=torch.int64) for _ in request.chunks]
