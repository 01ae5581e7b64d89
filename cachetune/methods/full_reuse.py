"""Full reuse (r = 0): every chunk token comes from the store as it was encoded alone; only the
uncached text (template, system prompt, question) is computed. The floor every reuse method is
measured against."""

from __future__ import annotations

import torch

from cachetune.methods.base import Method, NoSettings, register
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector

ORDER = 40


class FullReuseSelector(TokenSelector):
    """Nothing of any chunk; the ratio is ignored."""

    name = "full_reuse"

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.empty(0, dtype=torch.int64) for _ in request.chunks]


@register("full_reuse", summary="nothing but uncached text (r = 0)")
def _full_reuse(settings: NoSettings) -> Method:
    return SelectiveMethod(FullReuseSelector(), settings)
