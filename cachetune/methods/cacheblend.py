"""CacheBlend (Yao et al., EuroSys 2025): pick high-KV-deviation (HKVD) tokens at a check layer.

Every token runs the layers below the check layer in full context; at the check layer the fresh K/V
of every chunk token are compared with the stored ones, and the tokens that deviate most (one budget
of round(ratio * chunk tokens) over the whole context) are recomputed in all layers.

NOTE: our keys are stored before RoPE, and layer 0's K/V depend only on the token embedding, so at
layer 0 a chunk's stored K/V equal the in-context ones exactly: the first layer where a deviation can
show is layer 1, which is why the check layer is 1 (layer 0 runs in full, as in CacheBlend's code).
The selected tokens then run from layer 0 in selective prefill; redoing layer 0 for them costs
ratio / num_layers of a full prefill, while the reused layer-0 K/V of the others are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.config import EngineConfig
from cachetune.methods.base import MAX_LAYERS, Method, check_int, check_ratio, register
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top
from cachetune.runtime.forward import forward_active
from cachetune.runtime.kv_cache import KVCache

ORDER = 70


@dataclass(frozen=True)
class CheckLayerSettings:
    ratio: float = EngineConfig.ratio  # share of all chunk tokens recomputed (one budget over the context)
    check_layer: int = 1               # where deviations are measured (>= 1: layer 0 never deviates)

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_int("check_layer", self.check_layer, maximum=MAX_LAYERS)


class CacheBlendSelector(TokenSelector):
    """The chunk tokens whose `compares` ("value": CacheBlend's released code; "key": CacheSlide)
    deviate most at `settings.check_layer` (clamped below the model's last layer), one budget over
    the whole context."""

    name = "cacheblend"
    compares = "value"

    def __init__(self, settings: CheckLayerSettings):
        self.settings = settings

    @torch.no_grad()
    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        adapter, layout = request.adapter, request.layout
        check = min(self.settings.check_layer, adapter.num_layers - 1)
        device = adapter.device
        rows = torch.arange(layout.total, device=device)
        cache = KVCache.empty(check, layout.total, adapter.num_kv_heads, adapter.head_dim, adapter.dtype, device)
        hidden = adapter.embed(layout.input_ids.to(device))
        hidden = forward_active(adapter, hidden, rows, cache, layers=range(check))
        _, k, v = adapter.project_qkv(check, hidden)  # [T, Hkv, D], keys before RoPE like the store's
        deviations = []
        for start, seg in layout.chunk_segments:
            n = seg.chunk.num_tokens
            old_k, old_v = seg.chunk.load_layer(check, torch.arange(n))
            span = slice(start, start + n)
            new, old = (v[span], old_v) if self.compares == "value" else (k[span], old_k)
            deviations.append((new.float() - old.to(device).float()).pow(2).sum(dim=(1, 2)))
        sizes = [d.numel() for d in deviations]
        deviations = list(adapter.across_heads(torch.cat(deviations)).split(sizes)) if deviations else deviations
        return split_global_top(deviations, ratio)


@register("cacheblend", CheckLayerSettings, summary="the `ratio` of context tokens whose values deviate most at layer 1")
def _cacheblend(settings: CheckLayerSettings) -> Method:
    return SelectiveMethod(CacheBlendSelector(settings), settings)
