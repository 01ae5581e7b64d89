"""Request-time token selectors, one file per method, looked up by name."""

from cachetune.selectors.base import TokenSelector
from cachetune.selectors.cachetune import RankedSelector
from cachetune.selectors.full_reuse import FullReuseSelector

SELECTORS: dict[str, type[TokenSelector]] = {
    RankedSelector.name: RankedSelector,
    FullReuseSelector.name: FullReuseSelector,
}


def get_selector(name: str) -> TokenSelector:
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(sorted(SELECTORS))}") from None


__all__ = ["SELECTORS", "TokenSelector", "get_selector"]
