"""ProphetKV (Wang et al., ICML 2026): let the question pick the context tokens to recompute.

Stage 1 runs the question over the fully reused context (a full-reuse prefill) and records, at every
layer, its attention to each context token, averaged over heads, question positions and layers.
Stage 2 recomputes the top round(ratio * chunk tokens) of the whole context by that score in all
layers (one shared set). Both stages count toward time to first token.
"""

from __future__ import annotations

import torch

from cachetune.methods.base import Method, RatioSettings, register
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top
from cachetune.methods.signals import question_attention

ORDER = 90


class ProphetKVSelector(TokenSelector):
    name = "prophetkv"

    @torch.no_grad()
    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        # As published: stage 2 loads the reused KV again (cachetune's question signal keeps it).
        scores, _ = question_attention(request.adapter, request.layout, request.adapter.num_layers)
        return split_global_top(scores, ratio)


@register("prophetkv", RatioSettings,
          summary="the `ratio` of context tokens the question attends to most over a full-reuse pass")
def _prophetkv(settings: RatioSettings) -> Method:
    return SelectiveMethod(ProphetKVSelector(), settings)
