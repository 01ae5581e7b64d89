"""Rows in and out of vLLM's paged KV cache, in whatever layout its attention backend packs a block.

Writes go through the backend's own `do_kv_cache_update`, so no layout is written by hand. Reads need
the inverse, which no backend offers: `BlockLayout.probe` learns it from the backend itself, by
writing known values through `do_kv_cache_update` into a scratch block and seeing where each landed.
The result is a gather index valid for every block of that layer's cache; a round trip
(write, read back, compare) proves it for the backend in use.

Slots are vLLM's: block id x block size + offset in the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Values exactly representable in every float dtype a KV cache may have (bfloat16 holds integers up to
# 256 exactly): a probe writes an index in base-256 digits, one digit per pass.
DIGIT = 256


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots [end - start] of token positions [start, end) of a request whose blocks are `block_ids`."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


def write_rows(attention: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
               cache: torch.Tensor | None = None) -> None:
    """Write rotated keys and values [T, Hkv, D] of one layer at `slots` [T] through the layer's
    attention implementation (`attention` is vLLM's Attention module of that layer) into its paged
    cache, or into `cache` (a tensor shaped like blocks of it)."""
    cache = attention.kv_cache if cache is None else cache
    attention.impl.do_kv_cache_update(attention, keys.to(cache.dtype).contiguous(), values.to(cache.dtype).contiguous(),
                                      cache, slots.to(cache.device))


@dataclass
class BlockLayout:
    """Where token t's key and value elements live inside one packed block of a layer's cache."""

    keys: torch.Tensor    # [block_size, Hkv, D] int64: flat offsets within a block
    values: torch.Tensor  # [block_size, Hkv, D]
    block_size: int

    @classmethod
    def probe(cls, attention: torch.nn.Module, num_kv_heads: int, head_dim: int) -> BlockLayout:
        """Learn the packing of `attention`'s cache from its backend (touches only a scratch block)."""
        cache = attention.kv_cache
        block_shape = cache.shape[1:]
        numel = int(torch.tensor(block_shape).prod())
        block_size = _block_size(cache, num_kv_heads, head_dim)
        per_kind = block_size * num_kv_heads * head_dim
        index = torch.arange(2 * per_kind, dtype=torch.int64) + 1  # 0 marks "not written"
        found = torch.zeros(numel, dtype=torch.int64)
        scratch = torch.zeros((1, *block_shape), dtype=cache.dtype, device=cache.device)
        slots = torch.arange(block_size, device=cache.device)
        scale = 1
        remaining = index.clone()
        while bool((remaining > 0).any()):
            digit = (remaining % DIGIT).to(cache.dtype).view(2, block_size, num_kv_heads, head_dim)
            scratch.zero_()
            attention.impl.do_kv_cache_update(attention, digit[0].contiguous(), digit[1].contiguous(), scratch, slots)
            found += scratch.reshape(-1).to(torch.int64).cpu() * scale
            remaining //= DIGIT
            scale *= DIGIT
        where = torch.full((2 * per_kind,), -1, dtype=torch.int64)
        written = found.nonzero().flatten()
        where[found[written] - 1] = written
        if bool((where < 0).any()):
            raise ValueError("the attention backend's block layout could not be learned (elements not written)")
        keys, values = where.view(2, block_size, num_kv_heads, head_dim)
        return cls(keys.to(cache.device), values.to(cache.device), block_size)

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [T, Hkv, D] at `slots` [T] of a layer's paged `cache`."""
        flat = cache.reshape(cache.shape[0], -1)
        slots = slots.to(cache.device)
        blocks = (slots // self.block_size).view(-1, 1, 1)
        offsets = slots % self.block_size
        return flat[blocks, self.keys[offsets]], flat[blocks, self.values[offsets]]


def round_trip_error(attention: torch.nn.Module, layout: BlockLayout, num_kv_heads: int, head_dim: int) -> float:
    """Largest error after writing random rows through the backend into scratch blocks at scattered
    slots and reading them back with `layout` (0.0 when the learned layout is right)."""
    cache = attention.kv_cache
    blocks = 3
    scratch = torch.zeros((blocks, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    generator = torch.Generator().manual_seed(0)
    slots = torch.randperm(blocks * layout.block_size, generator=generator)[: layout.block_size + 5]
    shape = (slots.numel(), num_kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator).to(cache.dtype)
    values = torch.randn(shape, generator=generator).to(cache.dtype)
    write_rows(attention, keys, values, slots, scratch)
    read_keys, read_values = layout.read(scratch, slots)
    return max(float((read_keys.cpu() - keys).abs().max()), float((read_values.cpu() - values).abs().max()))


def _block_size(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Tokens per block of a cache whose blocks hold K and V of `num_kv_heads` x `head_dim` per token."""
    per_block = int(torch.tensor(cache.shape[1:]).prod())
    size, rest = divmod(per_block, 2 * num_kv_heads * head_dim)
    if rest:
        raise ValueError(f"a cache block of shape {tuple(cache.shape[1:])} does not hold whole K/V rows")
    return size
