"""Training-free 4x compressed chunk KV: the controls C2KV is measured against (issue 12).

Each chunk keeps one KV row per block of `block` tokens, placed at the position of the block's last
token (where C2KV puts its C2Token); nothing is recomputed. `keep_every_4th` keeps the last token's
K/V of every block, `block_mean_4` the mean pre-RoPE K and V of the block, rotated at that position.
Uncached text keeps its own positions: the question starts at the prompt head's length plus the
*original* lengths of the documents before it, so positions are those of the full prompt while the
KV cache holds about a quarter of the document rows. The rows' positions never decrease, so the
default causal attention (in row order) applies, for the prompt and for decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachetune.methods.base import Method, MethodContext, register
from cachetune.methods.layout import PromptLayout
from cachetune.methods.prefill import Prefill
from cachetune.runtime.forward import forward_active
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import LayerLoader
from cachetune.store.base import StoredChunk


@dataclass(frozen=True)
class BlockSettings:
    block: int = 4  # document tokens per kept KV row

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an integer >= 1, got {self.block!r}")


def block_ends(n: int, block: int) -> torch.Tensor:
    """Local index of the last token of each block of a chunk of n tokens: [ceil(n / block)]."""
    return torch.clamp(torch.arange(1, math.ceil(n / block) + 1) * block, max=n) - 1


class BlockRows:
    """A stored chunk seen as one row per block (runtime.loading.LayerSource): `load_layer(layer,
    blocks)` returns the kept or averaged pre-RoPE K/V [len(blocks), Hkv, D] of those blocks."""

    def __init__(self, chunk: StoredChunk, block: int, mean: bool):
        self.chunk, self.block, self.mean = chunk, block, mean

    def load_layer(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.chunk.num_tokens
        if not self.mean:
            return self.chunk.load_layer(layer, block_ends(n, self.block)[blocks])
        k, v = self.chunk.load_layer(layer, torch.arange(n))                 # [N, Hkv, D]
        owner = torch.arange(n, device=k.device) // self.block              # block of each token
        count = torch.bincount(owner).to(k.dtype)[:, None, None]           # the last block may be short
        sums_k = torch.zeros((int(owner[-1]) + 1, *k.shape[1:]), dtype=k.dtype, device=k.device)
        sums_v = torch.zeros_like(sums_k)
        k_mean = sums_k.index_add_(0, owner, k) / count
        v_mean = sums_v.index_add_(0, owner, v) / count
        idx = blocks.to(k.device)
        return k_mean[idx], v_mean[idx]


@torch.no_grad()
def compressed_prefill(adapter, layout: PromptLayout, capacity: int, block: int, mean: bool,
                       prefetch: bool = True) -> Prefill:
    """Uncached text computed at its own positions; every chunk as one reused row per block."""
    device = adapter.device
    active_rows, active_pos, parts, positions = [], [], [], []
    row = 0
    for start, seg in zip(layout.starts, layout.segments):
        n = int(seg.token_ids.numel())
        if seg.cached:
            pos = start + block_ends(n, block)
            rows = torch.arange(row, row + pos.numel())
            parts.append((BlockRows(seg.chunk, block, mean), torch.arange(pos.numel()), rows))
        else:
            pos = torch.arange(start, start + n)
            rows = torch.arange(row, row + n)
            active_rows.append(rows)
            active_pos.append(pos)
        positions.append(pos)
        row += pos.numel()
    cache = KVCache.empty(adapter.num_layers, max(capacity, row), adapter.num_kv_heads, adapter.head_dim,
                          adapter.dtype, device)
    cache.positions[:row] = torch.cat(positions).to(device)
    rows = torch.cat(active_rows).to(device)
    ids = torch.cat([s.token_ids for s in layout.segments if not s.cached]).to(device)
    with LayerLoader(parts, adapter.num_layers, device, adapter.dtype, prefetch) as loader:
        hidden = forward_active(adapter, adapter.embed(ids), rows, cache, reused=loader, last_only=True)
    return Prefill(cache, adapter.logits(hidden[-1:])[0], layout.total, int(rows.numel()), 0, prompt_rows=row)


class CompressedChunks(Method):
    def __init__(self, settings: BlockSettings, mean: bool):
        self.settings, self.mean = settings, mean

    def prompt_rows(self, layout: PromptLayout) -> int:
        block = self.settings.block
        return sum(math.ceil(s.token_ids.numel() / block) if s.cached else s.token_ids.numel()
                   for s in layout.segments)

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        if any(info.sliding_window is not None for info in ctx.adapter.layer_info):
            # Windows count rows as positions in the default attention; compressed rows break that.
            raise ValueError("compressed chunk KV does not support sliding-window attention yet")
        return compressed_prefill(ctx.adapter, layout, capacity, self.settings.block, self.mean, ctx.prefetch)


register("keep_every_4th", BlockSettings,
         summary="control, 4x: the K/V of the last token of every block of 4, at its position")(
    lambda settings: CompressedChunks(settings, mean=False))
register("block_mean_4", BlockSettings,
         summary="control, 4x: the mean K/V of every block of 4, at the block's last position")(
    lambda settings: CompressedChunks(settings, mean=True))
