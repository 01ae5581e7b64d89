"""Selectors that read an offline ranking: CacheTune, the analysis controls, and LF-only pruning."""

from __future__ import annotations

import torch

from cachetune.chunks.ranking import top_share
from cachetune.selectors.base import SelectionRequest, TokenSelector


class RankedSelector(TokenSelector):
    """Recompute the top `ratio` of each chunk by a query-independent ranking stored with the chunk.

    The same chunk recomputes the same tokens wherever it is placed and whatever the question.
    """

    def __init__(self, name: str = "cachetune", ranker: str = "lf", drops_unselected: bool = False):
        self.name, self.ranker, self.drops_unselected = name, ranker, drops_unselected

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [top_share(request.ranking(chunk, self.ranker), ratio) for chunk in request.chunks]


class FirstTokensSelector(TokenSelector):
    """EPIC (LegoLink): recompute the first `k` tokens of every chunk, whatever the ratio.

    A chunk encoded alone turns its first tokens into attention sinks; recomputing them in context
    removes the spurious sinks. k=16 as in the CacheTune paper's EPIC setting.
    """

    name = "epic"

    def __init__(self, k: int = 16):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.arange(min(self.k, chunk.num_tokens)) for chunk in request.chunks]


class FullReuseSelector(TokenSelector):
    """Full reuse (r = 0): every chunk token comes from the store; only uncached text is computed."""

    name = "full_reuse"

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.empty(0, dtype=torch.int64) for _ in request.chunks]
