"""A differentiable layer driver with an explicit visibility mask, for extraction and training.

The serving driver (forward.py) writes into a KVCache in place and runs under no_grad. Training an
extractor (C2KV) or link tokens (KVLink) needs the same per-layer steps with autograd through them,
with attention rules the causal kernels cannot express (block-local C2Tokens, documents that see only
themselves), over a few hundred queries. So here every layer takes the queries' context K/V from a
callback, and attention is one dense masked call. The model's weights stay frozen by the caller;
gradients flow to whatever produced the hidden states, the projections or the context.

Shapes have no batch dimension: hidden [T, hidden], keys/values [S, Hkv, D], visible [T, S] bool.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from cachetune.model.adapter import ModelAdapter

BACKENDS = ("sdpa", "eager")

# context(layer) -> (rotated keys, values) [P, Hkv, D] the active tokens see before their own rows.
ContextFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# capture(layer, k_pre_rope [T, Hkv, D], v [T, Hkv, D]) for every layer (the extracted KV).
CaptureFn = Callable[[int, torch.Tensor, torch.Tensor], None]
# projections(layer) -> (q, k, v) modules replacing the layer's own for these tokens (None: the model's).
ProjectionsFn = Callable[[int], Sequence[torch.nn.Module] | None]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                     backend: str = "sdpa") -> torch.Tensor:
    """q [T, Hq, D] over k/v [S, Hkv, D] where query i sees key j iff visible[i, j]; -> [T, Hq, D].

    A query that sees no key at all gets zeros, never NaN, in the output and in the gradients: the
    mask is additive with the dtype's most negative finite value (a row of -inf would be 0/0 in the
    softmax, the known NaN of SDPA kernels on fully masked rows), and such rows are zeroed after.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)                                       # [Hq, T, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)      # [Hq, S, D] (HF's repeat_kv order)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~visible.to(q.device), torch.finfo(q.dtype).min)
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=bias, scale=scale)[0]
    else:
        weights = torch.softmax((qh @ kh.transpose(1, 2)) * scale + bias, dim=-1, dtype=torch.float32)
        out = weights.to(vh.dtype) @ vh
    seen = visible.any(dim=1).to(q.device)                        # [T]
    return (out * seen[None, :, None].to(out.dtype)).transpose(0, 1)


def dense_forward(
    adapter: ModelAdapter,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
    context: ContextFn | None = None,
    projections: ProjectionsFn | None = None,
    capture: CaptureFn | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Run every layer for T active tokens; returns their final hidden states [T, hidden].

    hidden: [T, hidden] inputs of layer 0; positions: [T] their RoPE positions. At each layer the
    active tokens' keys are [context(layer) keys (P rows), their own fresh keys (T rows)], and
    visible: [T, P + T] says which of those each active query attends to (P = 0 without context).
    """
    rope = adapter.rope_tables(positions.to(adapter.device))
    for layer in range(adapter.num_layers):
        info = adapter.layer_info[layer]
        q, k, v = adapter.project_qkv(layer, hidden, projections(layer) if projections is not None else None)
        if capture is not None:
            capture(layer, k, v)
        cos, sin = rope[info.rope_kind]
        q, k = adapter.rotate(q, cos, sin), adapter.rotate(k, cos, sin)
        if context is not None:
            ck, cv = context(layer)
            k, v = torch.cat([ck, k]), torch.cat([cv, v])
        attn = masked_attention(q, k, v, visible, info.scale, backend)
        hidden = adapter.finish_layer(layer, hidden, attn)
    return hidden


def causal_after_context(context_rows: int, tokens: int, device=None) -> torch.Tensor:
    """visible [T, P + T] for tokens that see all P context rows and, causally, each other."""
    own = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(tokens, context_rows, dtype=torch.bool, device=device), own], dim=1)
