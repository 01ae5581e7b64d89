"""The fused selective forward: active tokens are computed, all other KV comes from the cache tier.

One function serves chunk encoding (every token active, no reused KV), selective prefill (selected
chunk tokens and uncached text active, the rest reused) and decoding (one new token active, everything
before it already in the KVCache). At each layer:

1. reused K/V for the layer (pre-RoPE keys, loaded while the previous layer computed) are rotated at
   their global positions and written into the KVCache rows of those positions;
2. active tokens get fresh Q/K/V from their current hidden states; K is rotated and written too;
3. active queries attend over all rows up to their own position (causal by global position);
4. output projection and MLP update the active hidden states, which feed the next layer.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from cachetune.engine.attention import plan_blocks, sparse_causal_attention
from cachetune.engine.kv_cache import KVCache
from cachetune.model.adapter import ModelAdapter


class ReusedKV(Protocol):
    """Source of reused KV, one layer at a time (see cachetune.engine.loading)."""

    positions: torch.Tensor  # [R] global positions of the reused rows

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values [R, Hkv, D] of layer `index`, rows in `positions` order."""


CaptureFn = Callable[[int, torch.Tensor, torch.Tensor], None]
# observe(layer, q [T, H, D] rotated, keys [end, Hkv, D] rotated): sees every active query and the
# layer's complete keys just before attention (ProphetKV scores context tokens with it).
ObserveFn = Callable[[int, torch.Tensor, torch.Tensor], None]
# fuse(layer, k, v) -> (k, v): rewrites the active tokens' fresh pre-RoPE K/V before they are cached.
FuseFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def forward_active(
    adapter: ModelAdapter,
    hidden: torch.Tensor,
    active_pos: torch.Tensor,
    cache: KVCache,
    rope: dict,
    reused: ReusedKV | None = None,
    capture: CaptureFn | None = None,
    last_only: bool = False,
    observe: ObserveFn | None = None,
    layers: range | None = None,
    fuse: FuseFn | None = None,
) -> torch.Tensor:
    """Run all layers for the active tokens and fill `cache` up to max(active_pos) + 1.

    hidden: [T, hidden] embeddings of the active tokens; active_pos: [T] strictly increasing global
    positions. rope: adapter.rope_tables over positions 0..capacity-1. `reused` must cover every
    position below max(active_pos) that is neither active nor already in `cache`. `capture(layer,
    k_pre_rope, v)` receives the active tokens' fresh K/V (chunk encoding stores these).
    Returns the active tokens' final hidden states [T, hidden], or only the last one [1, hidden] with
    `last_only`: the final layer still writes every active token's K/V (decoding needs them) but runs
    attention and MLP for the last token alone, since nothing reads the other outputs.
    `layers` runs a contiguous sub-range (default all): `hidden` must then be the input of its first
    layer, and the output is that of its last (CacheBlend's check layer runs layer 0 alone).
    """
    end = int(active_pos[-1]) + 1
    cache.ensure_capacity(end)
    layers = layers if layers is not None else range(adapter.num_layers)
    last = adapter.num_layers - 1
    # Everything that depends only on positions is computed once, not per layer.
    rp = reused.positions if reused is not None and reused.positions.numel() else None
    active_rope = {kind: (cos[active_pos], sin[active_pos]) for kind, (cos, sin) in rope.items()}
    reused_rope = {kind: (cos[rp], sin[rp]) for kind, (cos, sin) in rope.items()} if rp is not None else {}
    groups = adapter.num_heads // adapter.num_kv_heads
    plan = plan_blocks(active_pos, groups, adapter.dtype)
    last_pos = active_pos[-1:] if last_only else active_pos
    last_plan = plan_blocks(last_pos, groups, adapter.dtype) if last_only else plan
    for layer in layers:
        info = adapter.layer_info[layer]
        if rp is not None:
            rk, rv = reused.layer(layer)
            cache.keys[layer].index_copy_(0, rp, adapter.rotate(rk, *reused_rope[info.rope_kind]))
            cache.values[layer].index_copy_(0, rp, rv)
        q, k, v = adapter.project_qkv(layer, hidden)
        if capture is not None:
            capture(layer, k, v)
        if fuse is not None:
            k, v = fuse(layer, k, v)
        qcos, qsin = active_rope[info.rope_kind]
        q = adapter.rotate(q, qcos, qsin)
        cache.keys[layer].index_copy_(0, active_pos, adapter.rotate(k, qcos, qsin))
        cache.values[layer].index_copy_(0, active_pos, v)
        if observe is not None:
            observe(layer, q, cache.keys[layer, :end])
        q_pos, layer_plan = active_pos, plan
        if layer == last and last_only:
            q, hidden, q_pos, layer_plan = q[-1:], hidden[-1:], last_pos, last_plan
        attn = sparse_causal_attention(
            q, cache.keys[layer, :end], cache.values[layer, :end], q_pos, info.scale, info.sliding_window,
            plan=layer_plan,
        )
        hidden = adapter.finish_layer(layer, hidden, attn)
    cache.length = max(cache.length, end)
    return hidden
