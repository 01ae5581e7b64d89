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
repeat across chunks), so it keeps its own position and group per row and decodes with the same
attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachetune.engine.kv_cache import KVCache
from cachetune.engine.layout import PromptLayout
from cachetune.engine.prefill import PrefillResult
from cachetune.model.adapter import ModelAdapter


@dataclass(frozen=True)
class APEConfig:
    temperature: float = 0.9
    scale: float = 0.9

    def __post_init__(self) -> None:
        if not (0 < self.temperature <= 1 and 0 < self.scale <= 1):
            raise ValueError("APE temperature and scale must be in (0, 1]")


def ape_attention(q, keys, values, q_pos, key_pos, is_context, scale, window, cfg: APEConfig):
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


class APEResult(PrefillResult):
    """A prefill whose cache rows carry their own positions and context flags; decodes with APE."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, is_context: torch.Tensor, logits,
                 prompt_tokens: int, computed: int, cfg: APEConfig):
        super().__init__(cache, logits, prompt_tokens, computed, 0)
        self.positions = positions    # [capacity] position of every row
        self.is_context = is_context  # [capacity] bool
        self.cfg = cfg

    def extend(self, adapter: ModelAdapter, token_ids: list[int]) -> torch.Tensor:
        cache = self.cache
        start = cache.length
        n = len(token_ids)
        cache.ensure_capacity(start + n)
        self._ensure_rows(cache.capacity)
        next_pos = int(self.positions[start - 1]) + 1
        self.positions[start:start + n] = torch.arange(next_pos, next_pos + n)
        self.is_context[start:start + n] = False
        rows = torch.arange(start, start + n, device=adapter.device)
        hidden = adapter.embed(torch.tensor(token_ids, device=adapter.device))
        hidden = _ape_forward(adapter, hidden, rows, self, None)
        return adapter.logits(hidden)

    def _ensure_rows(self, capacity: int) -> None:
        extra = capacity - self.positions.numel()
        if extra > 0:
            self.positions = torch.cat([self.positions, self.positions.new_zeros(extra)])
            self.is_context = torch.cat([self.is_context, self.is_context.new_zeros(extra)])


def _ape_forward(adapter: ModelAdapter, hidden, rows, state: APEResult, chunk_rows) -> torch.Tensor:
    """All layers for the active `rows`; `chunk_rows` [(chunk, rows)] are loaded into the cache first."""
    cache = state.cache
    end = int(rows[-1]) + 1
    positions = state.positions[:end].to(adapter.device)
    tables = adapter.rope_tables(positions)
    is_context = state.is_context[:end].to(adapter.device)
    for layer in range(adapter.num_layers):
        info = adapter.layer_info[layer]
        cos, sin = tables[info.rope_kind]
        for chunk, crows in chunk_rows or []:
            k, v = chunk.load_layer(layer, torch.arange(chunk.num_tokens))
            k = k.to(adapter.device, adapter.dtype)
            cache.keys[layer].index_copy_(0, crows, adapter.rotate(k, cos[crows], sin[crows]))
            cache.values[layer].index_copy_(0, crows, v.to(adapter.device, adapter.dtype))
        q, k, v = adapter.project_qkv(layer, hidden)
        q = adapter.rotate(q, cos[rows], sin[rows])
        cache.keys[layer].index_copy_(0, rows, adapter.rotate(k, cos[rows], sin[rows]))
        cache.values[layer].index_copy_(0, rows, v)
        attn = ape_attention(q, cache.keys[layer, :end], cache.values[layer, :end], positions[rows], positions,
                             is_context, info.scale, info.sliding_window, state.cfg)
        hidden = adapter.finish_layer(layer, hidden, attn)
    cache.length = max(cache.length, end)
    return hidden


@torch.no_grad()
def ape_prefill(adapter: ModelAdapter, layout: PromptLayout, capacity: int,
                cfg: APEConfig | None = None) -> APEResult:
    """Prefix, then every cached chunk in parallel from the same position, then the question."""
    cfg = cfg or APEConfig()
    segs = layout.segments
    if segs[0].cached or any(not s.cached for s in segs[1:-1]):
        raise ValueError("APE needs the layout [uncached prefix, cached chunks..., uncached question]")
    device = adapter.device
    prefix = int(segs[0].token_ids.numel())
    longest = max((s.chunk.num_tokens for s in segs[1:-1]), default=0)
    positions = torch.empty(max(capacity, layout.total), dtype=torch.int64)
    is_context = torch.zeros_like(positions, dtype=torch.bool)
    chunk_rows = []
    for start, seg in layout.chunk_segments:
        n = seg.chunk.num_tokens
        positions[start:start + n] = torch.arange(prefix, prefix + n)
        is_context[start:start + n] = True
        chunk_rows.append((seg.chunk, torch.arange(start, start + n, device=device)))
    positions[:prefix] = torch.arange(prefix)
    q_start = layout.starts[-1]
    positions[q_start:layout.total] = torch.arange(prefix + longest, prefix + longest + layout.total - q_start)
    cache = KVCache.empty(adapter.num_layers, positions.numel(), adapter.num_kv_heads, adapter.head_dim,
                          adapter.dtype, device)
    state = APEResult(cache, positions, is_context, None, layout.total, 0, cfg)
    rows = torch.cat([torch.arange(prefix), torch.arange(q_start, layout.total)]).to(device)
    ids = layout.input_ids.to(device)[rows]
    hidden = _ape_forward(adapter, adapter.embed(ids), rows, state, chunk_rows)
    state.logits = adapter.logits(hidden[-1:])[0]
    state.computed_tokens = int(rows.numel())
    return state
