"""Controls for the analysis (the CacheTune paper's section 3, E.2, E.4): each chunk's top `ratio`
by another offline ranking than CacheTune's, with no online signal.

    random, l2, highfreq    recompute the chunk's top `ratio` by that ranking (chunks.rankers)
    lf_only                 keep the chunk's low-frequency top `ratio`, drop its other tokens from the prompt
"""

from __future__ import annotations

from cachetune.methods.base import Method, RatioSettings, register
from cachetune.methods.cachetune import RankedSelector, RankedSettings
from cachetune.methods.selector import SelectiveMethod

ORDER = 60


def ranked_alone(ranking: str) -> RankedSettings:
    """The selection by `ranking` alone: each chunk's share in proportion to its length, no signal."""
    return RankedSettings(ranking=ranking, allocation="proportional", signal="none")


for _control in ("random", "l2", "highfreq"):
    register(_control, RatioSettings, summary=f"control: the top `ratio` of each chunk by the `{_control}` ranking")(
        lambda settings, name=_control: SelectiveMethod(RankedSelector(ranked_alone(name), name), settings))


@register("lf_only", RatioSettings, summary="control: keep the low-frequency top `ratio` of each chunk, drop the rest")
def _lf_only(settings: RatioSettings) -> Method:
    return SelectiveMethod(RankedSelector(ranked_alone("lf"), "lf_only", drops_unselected=True), settings)
