"""Tensor parallelism for the blend: every rank blends its own heads, in step with the others.

Under vLLM's tensor parallelism a worker holds num_heads / tp query heads and its share of the KV
heads, and the model's own layers make the hidden state whole again on every rank (the embedding,
o_proj and down_proj all-reduce their outputs). So the runtime's layer-by-layer prefill runs
unchanged on each rank over its own heads, provided the ranks stay in step. What keeps them there:

- a score averaged over heads (the question's attention, CacheBlend's deviations) is averaged over
  every rank's heads (`HeadGroup.mean`), and every rank takes rank 0's copy of the result: the ranks
  pick the same tokens, so their forwards have the same shapes and their collectives match;
- a decision one rank takes alone (is every document intact in my tiers?) is agreed (`all`);
- documents are stored whole, every KV head, in the standalone engine's format: a rank reads its own
  heads of them (`shard`), and gathers every rank's heads before it stores one (`gather`).

With one rank (`HeadGroup.single`) each of these is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cachetune.store.base import StoredChunk


@dataclass(frozen=True)
class HeadGroup:
    """The KV heads this rank holds ([first, first + kv_heads) of total_kv_heads), and the
    collectives over the tensor-parallel ranks that hold the rest."""

    rank: int
    size: int
    first: int            # this rank's first KV head in the model's order
    kv_heads: int         # KV heads on this rank
    total_kv_heads: int   # the model's KV heads (what a stored document holds)
    replicas: int = 1     # ranks holding the same KV heads (when tp exceeds the KV heads)

    @classmethod
    def single(cls, kv_heads: int) -> HeadGroup:
        return cls(0, 1, 0, kv_heads, kv_heads)

    @classmethod
    def of(cls, qkv_proj: torch.nn.Module) -> HeadGroup:
        """This rank's heads, read from a layer's vLLM QKVParallelLinear."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        size, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        kv_heads, total = qkv_proj.num_kv_heads, qkv_proj.total_num_kv_heads
        replicas = getattr(qkv_proj, "num_kv_head_replicas", 1)
        return cls(rank, size, (rank // replicas) * kv_heads, kv_heads, total, replicas)

    @property
    def heads(self) -> slice:
        return slice(self.first, self.first + self.kv_heads)

    def mean(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [...] averaged over this rank's query heads -> averaged over the model's (every
        rank holds as many query heads); bit-identical on every rank."""
        if self.size == 1:
            return scores
        from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

        total = tensor_model_parallel_all_reduce(scores.float().contiguous()) / self.size
        return get_tp_group().broadcast(total, src=0).to(scores.dtype)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., kv_heads, D] of this rank's heads -> [..., total_kv_heads, D], every head once."""
        if self.size == 1:
            return rows
        from vllm.distributed import tensor_model_parallel_all_gather

        every = tensor_model_parallel_all_gather(rows.contiguous(), dim=-2)  # [..., size * kv_heads, D]
        if self.replicas > 1:  # ranks r and r + 1 ... hold the same heads: keep one rank's of each
            every = every.unflatten(-2, (self.size, self.kv_heads))[..., ::self.replicas, :, :].flatten(-3, -2)
        return every

    def all(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank."""
        if self.size == 1:
            return ok
        from vllm.distributed import tensor_model_parallel_all_reduce

        return bool(tensor_model_parallel_all_reduce(torch.tensor([0.0 if ok else 1.0])).item() == 0.0)

    def from_first(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a small picklable object)."""
        if self.size == 1:
            return value
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast_object(value, src=0)

    def shard(self, stored: StoredChunk) -> StoredChunk:
        """`stored` (every KV head) as this rank reads it: only its own heads."""
        return stored if self.kv_heads == self.total_kv_heads else HeadShard(stored, self.heads)


class HeadShard(StoredChunk):
    """Some KV heads of a stored chunk. It has no range reader: the loader reads it row by row
    (`load_layer`), which reads only the requested rows from the tier."""

    def __init__(self, stored: StoredChunk, heads: slice):
        self.stored, self.heads = stored, heads
        self.take_metadata(stored)
        self.tier = stored.tier

    @property
    def num_layers(self) -> int:
        return self.stored.num_layers

    @property
    def row_dtype(self) -> torch.dtype:
        return self.stored.row_dtype

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.stored.load_layer(layer, indices)  # [R, total_kv_heads, D]
        return keys[:, self.heads].contiguous(), values[:, self.heads].contiguous()
