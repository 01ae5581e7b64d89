"""Selectors that read an offline ranking (CacheTune, the analysis controls, LF-only pruning), EPIC's
first tokens and full reuse, and the methods built on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.chunks.rankers import get_ranker
from cachetune.chunks.ranking import ranking_from_scores, top_share
from cachetune.config import EngineConfig
from cachetune.methods.base import Method, NoSettings, RatioSettings, check_ratio, register
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top


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


@dataclass(frozen=True)
class RankedSettings:
    ratio: float = EngineConfig.ratio      # share of every chunk recomputed
    ranking: str = EngineConfig.ranking    # offline ranker (cachetune.chunks.rankers)

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        get_ranker(self.ranking)  # a clear error now rather than at the first request


@dataclass(frozen=True)
class EpicSettings:
    k: int = 16  # tokens recomputed at the start of every chunk (the CacheTune paper's EPIC setting)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k must be an integer >= 0, got {self.k!r}")


@register("cachetune", RankedSettings, suffix="ranking",
          summary="the top `ratio` of each chunk by its offline ranking (cachetune:<ranking> picks one)")
def _cachetune(settings: RankedSettings) -> Method:
    return SelectiveMethod(RankedSelector("cachetune", settings.ranking), settings)


@register("full_reuse", summary="nothing but uncached text (r = 0)")
def _full_reuse(settings: NoSettings) -> Method:
    return SelectiveMethod(FullReuseSelector(), settings)


@register("epic", EpicSettings, summary="the first k tokens of every chunk")
def _epic(settings: EpicSettings) -> Method:
    return SelectiveMethod(FirstTokensSelector(settings.k), settings)


# Controls for the analysis: the same budget per chunk, other offline rankings.
for _control in ("random", "l2", "highfreq"):
    register(_control, RatioSettings, summary=f"control: the top `ratio` of each chunk by the `{_control}` ranking")(
        lambda settings, name=_control: SelectiveMethod(RankedSelector(name, name), settings))


@register("lf_only", RatioSettings, summary="control: keep the low-frequency top `ratio` of each chunk, drop the rest")
def _lf_only(settings: RatioSettings) -> Method:
    return SelectiveMethod(RankedSelector("lf_only", "lf", drops_unselected=True), settings)
