"""Request-time token selectors, one file per family of methods, looked up by method name."""

from typing import Callable

from cachetune.selectors.base import SelectionRequest, TokenSelector, split_global_top
from cachetune.selectors.cacheblend import CacheBlendSelector
from cachetune.selectors.cacheslide import CacheSlideSelector
from cachetune.selectors.prophetkv import ProphetKVSelector
from cachetune.selectors.ranked import FirstTokensSelector, FullReuseSelector, RankedSelector

SELECTORS: dict[str, Callable[[], TokenSelector]] = {
    "cachetune": lambda: RankedSelector("cachetune", "lf"),
    "full_reuse": FullReuseSelector,
    "cacheblend": CacheBlendSelector,
    "epic": FirstTokensSelector,
    "prophetkv": ProphetKVSelector,
    "cacheslide": CacheSlideSelector,
    # Controls for the analysis: the same budget per chunk, other offline rankings.
    "random": lambda: RankedSelector("random", "random"),
    "l2": lambda: RankedSelector("l2", "l2"),
    "highfreq": lambda: RankedSelector("highfreq", "highfreq"),
    "lf_only": lambda: RankedSelector("lf_only", "lf", drops_unselected=True),
}


def get_selector(name: str) -> TokenSelector:
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(SELECTORS)}") from None


__all__ = ["SELECTORS", "RankedSelector", "SelectionRequest", "TokenSelector", "get_selector", "split_global_top"]
