"""ProphetKV (Wang et al., ICML 2026): let the question pick the context tokens to recompute.

Stage 1 runs the question over the fully reused context (a full-reuse prefill) and records, at every
layer, its attention to each context token, averaged over heads, question positions and layers.
Stage 2 recomputes the top round(ratio * chunk tokens) of the whole context by that score in all
layers (one shared set). Both stages count toward time to first token.
"""

from __future__ import annotations

import torch

from cachetune.methods.base import Method, RatioSettings, register
from cachetune.methods.layout import PromptLayout
from cachetune.methods.prefill import selective_prefill
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top
from cachetune.model.adapter import ModelAdapter


class QuestionAttention:
    """A forward observer: per layer, the question's attention over every key position.

    The question is the layout's last segment (it ends the prompt, so its queries are the last
    active rows). per_layer[l] is [total] float32: softmax attention averaged over heads and question
    positions (causal; each row sums to 1, so the vector does too).
    """

    def __init__(self, adapter: ModelAdapter, layout: PromptLayout):
        self.adapter = adapter
        self.q_pos = torch.arange(layout.starts[-1], layout.total, device=adapter.device)
        self.total = layout.total
        self.per_layer: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        groups = q.shape[1] // keys.shape[1]
        qq = q[-self.q_pos.numel():].float()                         # [Tq, H, D]
        k = keys.float().repeat_interleave(groups, dim=1)            # [end, H, D]
        logits = torch.einsum("thd,shd->hts", qq, k) * self.adapter.layer_info[layer].scale
        causal = torch.arange(keys.shape[0], device=k.device)[None, :] > self.q_pos[:, None]
        probs = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
        row = torch.zeros(self.total, device=k.device)
        row[: keys.shape[0]] = probs.mean(dim=(0, 1))
        self.per_layer.append(row)

    def mean(self) -> torch.Tensor:
        return torch.stack(self.per_layer).mean(dim=0)


class ProphetKVSelector(TokenSelector):
    name = "prophetkv"

    @torch.no_grad()
    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        adapter, layout = request.adapter, request.layout
        observer = QuestionAttention(adapter, layout)
        none = [torch.empty(0, dtype=torch.int64) for _ in layout.chunk_segments]
        selective_prefill(adapter, layout, none, layout.total, observe=observer)
        attention = observer.mean()
        scores = [attention[start:start + seg.chunk.num_tokens] for start, seg in layout.chunk_segments]
        return split_global_top(scores, ratio)


@register("prophetkv", RatioSettings,
          summary="the `ratio` of context tokens the question attends to most over a full-reuse pass")
def _prophetkv(settings: RatioSettings) -> Method:
    return SelectiveMethod(ProphetKVSelector(), settings)
