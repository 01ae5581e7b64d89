"""Request-time token selectors, one file per family of methods, looked up by method name."""

from typing import Callable

from cachetune.chunks.rankers import get_ranker
from cachetune.selectors.base import SelectionRequest, TokenSelector, split_global_top
from cachetune.selectors.cacheblend import CacheBlendSelector
from cachetune.selectors.cacheslide import CacheSlideSelector
from cachetune.selectors.prophetkv import ProphetKVSelector
from cachetune.selectors.ranked import FirstTokensSelector, FullReuseSelector, RankedSelector

SELECTORS: dict[str, Callable[[], TokenSelector]] = {
    "cachetune": lambda: RankedSelector("cachetune", None),  # the engine's configured ranking
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
    """A selector by method name; "cachetune:<ranker>" is cachetune with that offline ranking."""
    base, sep, spec = name.partition(":")
    if base == "cachetune" and sep:
        get_ranker(spec)  # a clear error now rather than at the first request
        return RankedSelector(name, spec)
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(SELECTORS)}, cachetune:<ranker>") from None


def is_selector(name: str) -> bool:
    try:
        get_selector(name)
    except ValueError:
        return False
    return True


__all__ = ["SELECTORS", "RankedSelector", "SelectionRequest", "TokenSelector", "get_selector", "is_selector",
           "split_global_top"]
