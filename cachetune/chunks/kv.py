"""Encode a run of tokens and keep every layer's pre-RoPE K and V (chunk caching and probing)."""

from __future__ import annotations

from typing import Protocol

import torch

from cachetune.runtime.forward import forward_active
from cachetune.runtime.kv_cache import KVCache
from cachetune.model.adapter import ModelAdapter


class Prefix(Protocol):
    """KV of tokens at positions 0..P-1 that the encoded run follows (the ReusedKV protocol)."""

    token_ids: torch.Tensor
    rows: torch.Tensor

    def begin(self, rotate) -> bool: ...

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@torch.no_grad()
def encode_kv(adapter: ModelAdapter, token_ids: torch.Tensor, prefix: Prefix | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values [L, N, Hkv, D] of `token_ids`, placed at positions 0..N-1, or right
    after `prefix` (which then attends as context but is not recomputed)."""
    ids = token_ids.to(adapter.device, torch.int64)
    start = 0 if prefix is None else prefix.token_ids.numel()
    n = ids.numel()
    shape = (adapter.num_layers, n, adapter.num_kv_heads, adapter.head_dim)
    keys = torch.empty(shape, dtype=adapter.dtype, device=adapter.device)
    values = torch.empty_like(keys)

    def capture(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keys[layer] = k
        values[layer] = v

    cache = KVCache.empty(adapter.num_layers, start + n, adapter.num_kv_heads, adapter.head_dim, adapter.dtype,
                          adapter.device)
    rows = torch.arange(start, start + n, device=adapter.device)  # row i at position i
    # last_only: every layer still captures all tokens' K/V; only the unused final outputs are skipped.
    forward_active(adapter, adapter.embed(ids), rows, cache, reused=prefix, capture=capture, last_only=True)
    return keys, values
