"""CacheSlide (Liu et al., FAST 2026), its Weighted Correction Attention adapted to chunk reuse.

Reusable documents are CacheSlide's fixed segments and the question its updated segment (always
computed). Selection follows the public description of WCA: all tokens run the layers below a check
layer (1) in full, and the chunk tokens whose keys deviate most from the stored ones (squared L2
over heads and dims, one budget of round(ratio * chunk tokens) over the whole context) are
recomputed. Correction: from layer 2 on, the recomputed K/V are not written as they are but blended
with the stored ones, per token,

    a = clamp(||K_new - K_cached||^2 / ||K_cached||^2, 0, 1);   K, V <- a * new + (1 - a) * cached

so a token that barely moved keeps its cached KV and one that moved a lot takes the new KV.

Adaptations (docs/methods.md): keys are compared before RoPE (our store keeps them so); the ratio
is the harness's r instead of CacheSlide's 26%, for equal budgets; the periodic re-selection every
4 layers and CCPE (which needs CoPE fine-tuning) are not implemented; the weight is clamped to [0, 1].
"""

from __future__ import annotations

import torch

from cachetune.methods.base import Method, register
from cachetune.methods.cacheblend import CacheBlendSelector, CheckLayerSettings
from cachetune.methods.selector import SelectionRequest, SelectiveMethod
from cachetune.runtime.forward import FuseFn

ORDER = 80
FIRST_FUSED_LAYER = 2  # the first layer whose recomputed K/V are blended with the stored ones


class CacheSlideSelector(CacheBlendSelector):
    """CacheBlend's selection by key deviation, whose recomputed K/V are blended into the stored ones."""

    name = "cacheslide"
    compares = "key"

    def fusion(self, request: SelectionRequest, selections: list[torch.Tensor]) -> FuseFn:
        adapter, layout = request.adapter, request.layout
        # Active rows in selective prefill are in position order: uncached text and the selected
        # chunk tokens. Find which rows are selected chunk tokens and where their stored KV lives.
        active = torch.ones(layout.total, dtype=torch.bool)
        owner = []  # (chunk, local indices, global positions) of each chunk's selected tokens
        for (start, seg), chosen in zip(layout.chunk_segments, selections):
            active[start:start + seg.chunk.num_tokens] = False
            active[start + chosen] = True
            owner.append((seg.chunk, chosen, start + chosen))
        row_of = torch.cumsum(active.long(), 0) - 1  # global position -> active row

        def fuse(layer: int, k: torch.Tensor, v: torch.Tensor):
            if layer < FIRST_FUSED_LAYER:
                return k, v
            k, v = k.clone(), v.clone()
            for chunk, local, pos in owner:
                if not local.numel():
                    continue
                rows = row_of[pos].to(k.device)
                old_k, old_v = (x.to(k.device, k.dtype) for x in chunk.load_layer(layer, local))
                new_k, new_v = k[rows], v[rows]
                moved = adapter.across_heads((new_k.float() - old_k.float()).pow(2).sum(dim=(1, 2)))
                base = adapter.across_heads(old_k.float().pow(2).sum(dim=(1, 2))).clamp_min(1e-12)
                a = (moved / base).clamp(0, 1).to(k.dtype)[:, None, None]
                k[rows] = a * new_k + (1 - a) * old_k
                v[rows] = a * new_v + (1 - a) * old_v
            return k, v

        return fuse


@register("cacheslide", CheckLayerSettings,
          summary="like CacheBlend by key deviation, recomputed K/V blended into the cached ones")
def _cacheslide(settings: CheckLayerSettings) -> Method:
    return SelectiveMethod(CacheSlideSelector(settings), settings)
