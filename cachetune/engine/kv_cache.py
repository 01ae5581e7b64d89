"""The per-request KV cache that prefill fills and decoding extends."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Rotated keys and values for every layer, indexed by global position.

    keys/values: [layers, capacity, kv_heads, head_dim]; rows [0, length) are valid. Row i always holds
    the token at global position i, so attention never needs a position map.
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, layers: int, capacity: int, kv_heads: int, head_dim: int, dtype, device) -> "KVCache":
        shape = (layers, capacity, kv_heads, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def ensure_capacity(self, needed: int) -> None:
        """Grow (by copying) so that `needed` rows fit; decoding past the planned budget stays correct."""
        if needed <= self.capacity:
            return
        extra = max(needed - self.capacity, self.capacity // 2)
        pad = (self.keys.shape[0], extra, *self.keys.shape[2:])
        self.keys = torch.cat([self.keys, self.keys.new_empty(pad)], dim=1)
        self.values = torch.cat([self.values, self.values.new_empty(pad)], dim=1)

    def truncate(self, length: int) -> None:
        """Forget rows from `length` on (e.g. to decode again from the end of the prompt)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        self.length = length

    @classmethod
    def from_hf(cls, cache, capacity: int) -> "KVCache":
        """Copy a transformers cache (per layer [1, Hkv, T, D]) into this layout."""
        layers = cache.layers
        first = layers[0].keys
        t = first.shape[2]
        if any(layer.keys.shape[2] != t for layer in layers):
            raise ValueError("cache layers hold different lengths (a sliding-window cache?); cannot copy")
        out = cls.empty(len(layers), max(capacity, t), first.shape[1], first.shape[3], first.dtype, first.device)
        for i, layer in enumerate(layers):
            out.keys[i, :t] = layer.keys[0].transpose(0, 1)
            out.values[i, :t] = layer.values[0].transpose(0, 1)
        out.length = t
        return out
