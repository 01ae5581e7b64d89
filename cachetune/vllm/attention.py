"""A blend's causal attention through vLLM's own CPU attention kernel.

The selected tokens of a blend sit at scattered positions, and each attends to every key up to its
own. vLLM's paged kernel computes exactly that for a batch of sequences whose queries are the last
tokens of each: so every run of consecutive query positions becomes one sequence, all sharing one
block table over the prompt's rows. Per layer, the rows the runtime has staged [0, end) are packed
into a scratch paged cache through the backend's own `do_kv_cache_update` (never vLLM's cache, whose
blocks other requests may share), and the kernel reads them from there.

Measured on a 6K-token MuSiQue blend (940 queries in 43 runs, SmolLM2 float32, 2 threads, AVX512 EPYC):
19 ms a layer against 48 ms for the runtime's block-sparse torch attention, equal within 1e-6.

Only vLLM's CPU backend is driven this way (its kernel and scheduler metadata are its own); any other
backend, dtype or a windowed layer uses the runtime's attention.
"""

from __future__ import annotations

import torch

from cachetune.runtime.attention import QueryBlock, sparse_causal_attention
from cachetune.vllm.paged import write_rows

CPU_BACKEND = "CPUAttentionBackendImpl"


def query_runs(q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive positions in strictly increasing `q_pos` [T]: query_start_loc [runs + 1]
    (int32, the first query of each run, then T) and seq_lens [runs] (int32, last position + 1)."""
    pos = q_pos.to("cpu", torch.int64)
    breaks = (pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), breaks))
    ends = torch.cat((breaks, torch.tensor([pos.numel()])))
    return torch.cat((starts, ends[-1:])).to(torch.int32), (pos[ends - 1] + 1).to(torch.int32)


class PagedCausalAttention:
    """`sparse_causal_attention` for the layers of a vLLM model, on vLLM's CPU kernel where it applies.

    Called as kernel(layer, q [T, Hq, D], keys [N, Hkv, D], values [N, Hkv, D], q_pos [T], scale,
    sliding_window, plan) -> [T, Hq, D], keys and values rotated, row i at position i (the runtime's
    contract). Metadata depends only on q_pos, so it is built once for all layers of a pass."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.attentions = [layer.self_attn.attn for layer in layers]  # vLLM's Attention modules
        self._scratch: torch.Tensor | None = None
        self._runs: tuple[torch.Tensor, ...] | None = None  # (q_pos it is for, start loc, seq lens, metadata)

    def applies(self, layer: int, q: torch.Tensor, sliding_window: int | None) -> bool:
        attention = self.attentions[layer]
        impl = attention.impl
        return (type(impl).__name__ == CPU_BACKEND and q.device.type == "cpu" and sliding_window is None
                and q.dtype == attention.kv_cache.dtype and getattr(impl, "sinks", None) is None
                and getattr(impl, "alibi_slopes", None) is None and not getattr(impl, "logits_soft_cap", None)
                and getattr(impl, "kv_cache_dtype", "auto") == "auto")

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                 scale: float, sliding_window: int | None, plan: list[QueryBlock] | None) -> torch.Tensor:
        if not self.applies(layer, q, sliding_window):
            return sparse_causal_attention(q, keys, values, q_pos, scale, sliding_window, plan=plan)
        from vllm import _custom_ops as ops

        attention = self.attentions[layer]
        block_shape = attention.kv_cache.shape[1:]  # [Hkv, block size, 2 x D] on this backend
        block_size = block_shape[1]
        n = keys.shape[0]
        blocks = -(-n // block_size)
        cache = self._scratch_for(blocks, block_shape, q.dtype)
        write_rows(attention, keys, values, torch.arange(n), cache)
        start_loc, seq_lens, metadata = self._metadata(q_pos, q.shape[1], keys.shape[1], keys.shape[2], attention)
        paged = cache.view(cache.shape[0], block_shape[0], 2 * block_size, -1)
        key_cache, value_cache = paged.chunk(2, dim=2)
        table = torch.arange(blocks, dtype=torch.int32).expand(seq_lens.numel(), blocks)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q.contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=start_loc, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table.contiguous(), softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return out

    def _scratch_for(self, blocks: int, block_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        scratch = self._scratch
        if scratch is None or scratch.shape[0] < blocks or scratch.shape[1:] != block_shape or scratch.dtype != dtype:
            # Zeroed, not empty: the kernel reads whole blocks, and a masked-out slot holding NaN bits
            # would still poison the weighted sum (0 x NaN); a reused scratch holds only finite rows.
            scratch = self._scratch = torch.zeros((blocks, *block_shape), dtype=dtype)
        return scratch[:blocks]

    def _metadata(self, q_pos: torch.Tensor, heads: int, kv_heads: int, head_dim: int, attention):
        if self._runs is not None and self._runs[0] is q_pos:
            return self._runs[1:]
        from vllm import _custom_ops as ops
        from vllm import envs

        start_loc, seq_lens = query_runs(q_pos)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
            dtype=attention.kv_cache.dtype, query_start_loc=start_loc, causal=True, sliding_window_size=-1,
            isa=attention.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        self._runs = (q_pos, start_loc, seq_lens, metadata)
        return start_loc, seq_lens, metadata


def kernel_error(kernel: PagedCausalAttention, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 scales: list[float], rows: int = 700) -> float | None:
    """The largest difference, over every layer, between `kernel` and the runtime's attention for random
    queries at scattered positions (runs and lone tokens, the shape of a blend's selection) over `rows`
    keys; None when the kernel applies to no layer (the runtime's attention serves them all)."""
    generator = torch.Generator().manual_seed(0)
    q_pos = torch.randperm(rows - 1, generator=generator)[: rows // 4].sort().values
    q_pos = torch.unique(torch.cat((q_pos, torch.arange(rows // 2, rows // 2 + 40), torch.tensor([rows - 1]))))
    q = torch.randn(q_pos.numel(), heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
    errors = []
    for layer, scale in enumerate(scales):
        if kernel.applies(layer, q, None):
            got = kernel(layer, q, keys, values, q_pos, scale, None, None)
            want = sparse_causal_attention(q.float(), keys.float(), values.float(), q_pos, scale)
            errors.append(float((got.float() - want).abs().max()))
    return max(errors) if errors else None
