"""APE, adaptive parallel encoding (Yang et al., ICLR 2025), training-free, over our chunk store.

Contexts are placed in parallel: every chunk starts right after the shared prefix (the template head
with the system prompt), so positions do not grow with the number of chunks, and no chunk attends to
another. The question (and every generated token) comes after the longest chunk and attends to the
prefix, all chunks and itself. To make up for the missing cross-chunk encoding APE reshapes that
attention (paper section 4):
  - attention temperature T < 1 sharpens the distribution within the contexts: softmax(z / T);
  - the contexts' share is set by their log-mass T * logsumexp(z / T) plus log S, scaling factor
    S < 1, merged with the prefix/question group by log-sum-exp weights.
Defaults T = S = 0.9 (the APE README's).

Adaptation (documented in docs/methods.md): APE encodes each context after the shared prefix; our
store keeps chunks encoded alone (shared with every other method), so a chunk's first token is its
own attention sink. Rows of this method's cache are in prompt order, not position order (positions
repeat across chunks): the KV cache carries each row's position, and the method's attention (used for
the prompt and for every decoded token) reads positions and context flags per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachetune.methods.base import Method, MethodContext, register
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import Prefill
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.forward import forward_active
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import LayerLoader, Pipeline

ORDER = 20


@dataclass(frozen=True)
class APESettings:
    temperature: float = 0.9  # attention temperature over the contexts (the APE README's default)
    scale: float = 0.9        # scaling factor of the contexts' share

    def __post_init__(self) -> None:
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (self.temperature, self.scale))
        if not (numbers and 0 < self.temperature <= 1 and 0 < self.scale <= 1):
            raise ValueError("APE temperature and scale must be in (0, 1]")


def ape_attention(q, keys, values, q_pos, key_pos, is_context, scale, window, cfg: APESettings):
    """q [Tq, H, D]; keys/values [R, Hkv, D] rotated; q_pos [Tq], key_pos [R]; is_context [R] bool.

    Causal by position (a context key is visible to a query at a later position). Returns [Tq, H, D].
    """
    groups = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, dim=1)
    v = values.float().repeat_interleave(groups, dim=1)
    z = torch.einsum("thd,rhd->htr", q.float(), k) * scale                      # [H, Tq, R]
    visible = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    own = visible & ~is_context[None, :]
    ctx = visible & is_context[None, :]
    z_own = z.masked_fill(~own, float("-inf"))
    z_ctx = (z / cfg.temperature).masked_fill(~ctx, float("-inf"))
    lse_own = torch.logsumexp(z_own, dim=-1)                                      # [H, Tq]
    lse_ctx = cfg.temperature * torch.logsumexp(z_ctx, dim=-1) + math.log(cfg.scale)
    w_ctx = torch.sigmoid(lse_ctx - lse_own).nan_to_num(0.0).unsqueeze(-1)       # no context -> 0
    p_own = torch.softmax(z_own, dim=-1).nan_to_num(0.0)
    p_ctx = torch.softmax(z_ctx, dim=-1).nan_to_num(0.0)
    out = (1 - w_ctx) * torch.einsum("htr,rhd->htd", p_own, v) + w_ctx * torch.einsum("htr,rhd->htd", p_ctx, v)
    return out.transpose(0, 1).to(q.dtype)


class APEAttention:
    """runtime.forward.AttentionFn for a cache whose first rows are flagged as context (the chunks)."""

    def __init__(self, adapter: ModelAdapter, is_context: torch.Tensor, cfg: APESettings):
        self.adapter = adapter
        self.is_context = is_context  # [prompt rows] bool; rows appended later are never context
        self.cfg = cfg

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, rows: torch.Tensor) -> torch.Tensor:
        end = int(rows[-1]) + 1
        flags = torch.zeros(end, dtype=torch.bool, device=q.device)
        known = min(end, self.is_context.numel())
        flags[:known] = self.is_context[:known]
        info = self.adapter.layer_info[layer]
        positions = cache.positions[:end]
        return ape_attention(q, cache.keys[layer, :end], cache.values[layer, :end], positions[rows], positions,
                             flags, info.scale, info.sliding_window, self.cfg)


@torch.no_grad()
def ape_prefill(adapter: ModelAdapter, layout: PromptLayout, capacity: int, cfg: APESettings | None = None,
                pipeline: Pipeline = Pipeline()) -> Prefill:
    """Prefix, then every cached chunk in parallel from the same position, then the question."""
    cfg = cfg or APESettings()
    segs = layout.segments
    if segs[0].cached or any(not s.cached for s in segs[1:-1]):
        raise ValueError("APE needs the layout [uncached prefix, cached chunks..., uncached question]")
    device = adapter.device
    prefix = int(segs[0].token_ids.numel())
    longest = max((s.chunk.num_tokens for s in segs[1:-1]), default=0)
    cache = KVCache.empty(adapter.num_layers, max(capacity, layout.total), adapter.num_kv_heads, adapter.head_dim,
                          adapter.dtype, device)
    positions = torch.arange(layout.total)
    is_context = torch.zeros(layout.total, dtype=torch.bool)
    parts = []
    for start, seg in layout.chunk_segments:
        n = seg.chunk.num_tokens
        positions[start:start + n] = torch.arange(prefix, prefix + n)
        is_context[start:start + n] = True
        parts.append((seg.chunk, torch.arange(n), torch.arange(start, start + n)))
    q_start = layout.starts[-1]
    positions[q_start:] = torch.arange(prefix + longest, prefix + longest + layout.total - q_start)
    cache.positions[:layout.total] = positions.to(device)
    rows = torch.cat([torch.arange(prefix), torch.arange(q_start, layout.total)]).to(device)
    ids = layout.input_ids.to(device)[rows]
    attention = APEAttention(adapter, is_context.to(device), cfg)
    with LayerLoader(parts, adapter.kv_shape, device, adapter.dtype, pipeline) as loader:
        hidden = forward_active(adapter, adapter.embed(ids), rows, cache, reused=loader, last_only=True,
                                attention=attention)
    logits = adapter.logits(hidden[-1:])[0]
    return Prefill(cache, logits, layout.total, int(rows.numel()), 0, attention=attention,
                   reused_rows=int(loader.rows.numel()))


class APE(Method):
    def __init__(self, settings: APESettings):
        self.settings = settings

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        return ape_prefill(ctx.adapter, layout, capacity, self.settings, ctx.pipeline)


register("ape", APESettings, summary="nothing; chunks in parallel positions, attention temperature and scale")(APE)
