"""ProphetKV (Wang et al., ICML 2026): let the question pick the context tokens to recompute.

Stage 1 runs the question over the fully reused context (a full-reuse prefill) and records, at every
layer, its attention to each context token, averaged over heads, question positions and layers.
Stage 2 recomputes the top round(ratio * chunk tokens) of the whole context by that score in all
layers (one shared set). Both stages count toward time to first token.
"""

from __future__ import annotations

import torch

from cachetune.engine.prefill import selective_prefill
from cachetune.selectors.base import SelectionRequest, TokenSelector, split_global_top


class ProphetKVSelector(TokenSelector):
    name = "prophetkv"

    @torch.no_grad()
    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        adapter, layout = request.adapter, request.layout
        device = adapter.device
        q_start = layout.starts[-1]                      # the last segment: the question, uncached
        q_pos = torch.arange(q_start, layout.total, device=device)
        attention = torch.zeros(layout.total, device=device)
        groups = adapter.num_heads // adapter.num_kv_heads

        def observe(layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
            # q: [T_active, H, D]; the question's rows are the last ones (it ends the prompt).
            qq = q[-q_pos.numel():].float()
            k = keys.float().repeat_interleave(groups, dim=1)       # [end, H, D]
            logits = torch.einsum("thd,shd->hts", qq, k) * adapter.layer_info[layer].scale
            causal = torch.arange(keys.shape[0], device=device)[None, :] > q_pos[:, None]
            probs = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
            attention[: keys.shape[0]] += probs.mean(dim=(0, 1))

        none = [torch.empty(0, dtype=torch.int64) for _ in layout.chunk_segments]
        selective_prefill(adapter, layout, none, layout.total, observe=observe)
        scores = [attention[start:start + seg.chunk.num_tokens] for start, seg in layout.chunk_segments]
        return split_global_top(scores, ratio)
