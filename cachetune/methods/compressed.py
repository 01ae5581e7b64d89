"""Training-free 4x compressed chunk KV: the controls C2KV is measured against (what training adds).

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

from cachetune.c2kv.extractor import block_ends
from cachetune.methods.base import MAX_TOKENS, Method, MethodContext, check_int, register
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import Prefill, compressed_prefill
from cachetune.runtime.loading import Pipeline
from cachetune.store.base import StoredChunk

ORDER = 100


@dataclass(frozen=True)
class BlockSettings:
    block: int = 4  # document tokens per kept KV row

    def __post_init__(self) -> None:
        check_int("block", self.block, maximum=MAX_TOKENS)


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


class CompressedChunks(Method):
    def __init__(self, settings: BlockSettings, mean: bool):
        self.settings, self.mean = settings, mean

    def prompt_rows(self, layout: PromptLayout) -> int:
        return compressed_rows(layout, self.settings.block)

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        return block_prefill(ctx.adapter, layout, capacity, self.settings.block, self.mean, ctx.pipeline)


def block_prefill(adapter, layout: PromptLayout, capacity: int, block: int, mean: bool,
                  pipeline: Pipeline = Pipeline()) -> Prefill:
    """Every chunk as one row per block (its last token's K/V, or the block mean), nothing recomputed."""

    def rows_of(seg: Segment):
        return BlockRows(seg.chunk, block, mean), block_ends(seg.chunk.num_tokens, block)

    return compressed_prefill(adapter, layout, capacity, rows_of, pipeline)


def compressed_rows(layout: PromptLayout, block: int) -> int:
    """KV rows of a prompt whose chunks keep one row per block of `block` tokens."""
    return sum(math.ceil(s.token_ids.numel() / block) if s.cached else s.token_ids.numel() for s in layout.segments)


register("keep_every_4th", BlockSettings,
         summary="control, 4x: the K/V of the last token of every block of 4, at its position")(
    lambda settings: CompressedChunks(settings, mean=False))
register("block_mean_4", BlockSettings,
         summary="control, 4x: the mean K/V of every block of 4, at the block's last position")(
    lambda settings: CompressedChunks(settings, mean=True))
