"""EPIC (LegoLink, ICML 2025): recompute the first `k` tokens of every chunk, whatever the ratio.

A chunk encoded alone turns its first tokens into attention sinks; recomputing them in context
removes the spurious sinks. k = 16 as in the CacheTune paper's EPIC setting (LegoLink-16). EPIC's
paper skips the first chunk, which starts its prompts; here every chunk follows the system prompt,
so every chunk is treated alike (docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.methods.base import MAX_TOKENS, Method, check_int, register
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector

ORDER = 50


@dataclass(frozen=True)
class EpicSettings:
    k: int = 16  # tokens recomputed at the start of every chunk (the CacheTune paper's EPIC setting)

    def __post_init__(self) -> None:
        check_int("k", self.k, minimum=0, maximum=MAX_TOKENS)


class FirstTokensSelector(TokenSelector):
    """The first `settings.k` tokens of every chunk (all of a shorter one); the ratio is ignored."""

    name = "epic"

    def __init__(self, settings: EpicSettings):
        self.settings = settings

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.arange(min(self.settings.k, chunk.num_tokens)) for chunk in request.chunks]


@register("epic", EpicSettings, summary="the first k tokens of every chunk")
def _epic(settings: EpicSettings) -> Method:
    return SelectiveMethod(FirstTokensSelector(settings), settings)
