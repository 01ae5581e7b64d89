"""Causal attention for a sparse, position-sorted set of queries over a full key buffer.

Selective prefill recomputes only some tokens, so its queries are a subset of the prompt positions
while its keys cover every position. A dense boolean mask over [queries, keys] wastes most of its work
on masked-out entries and forces the slow masked kernel. Instead queries are split into blocks of
consecutive positions: everything before a block's first position is visible to the whole block and
is attended without a mask; only the short span inside the block needs one. The two partial results
are merged exactly through their log-sum-exp, so the result equals dense causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Queries per scattered block: the masked kernel computes every query against the block's whole span.
QUERY_BLOCK = 128
# Consecutive runs at least this long are causal blocks of their own unless a cheap merge says otherwise.
MIN_RUN = 32
# Joining the next run to a block saves two kernel calls and one merge (about a quarter of a millisecond
# on a 2-core CPU) and costs the masked query-key products it adds. The join is taken while those stay
# under this many, the price of the saved calls in products on a small model: a chunk's few question
# picks then ride with the next chunk's first tokens instead of paying their own pass over the prefix.
MERGE_CELLS = 8192


def _fold_gqa(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q: [T, Hq, D] -> [1, Hkv, G*T, D]; query head h uses kv head h // G (HF's repeat_kv order)."""
    t, hq, d = q.shape
    g = hq // kv_heads
    return q.view(t, kv_heads, g, d).permute(1, 2, 0, 3).reshape(1, kv_heads, g * t, d)


def _unfold_gqa(o: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of _fold_gqa: [1, Hkv, G*T, D] -> [T, Hq, D]."""
    _, hkv, gt, d = o.shape
    g = gt // t
    return o.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hkv * g, d)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> [1, H, N, D]."""
    return x.transpose(0, 1).unsqueeze(0)


def _attend_with_lse(q, k, v, mask, scale, causal=False):
    """CPU flash attention of q [1,H,L,D] over k/v [1,H,S,D]: output and log-sum-exp [1,H,L].

    causal=True (only with L == S) lets query i see keys 0..i; `mask` is additive, in q's dtype.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=mask, scale=scale
    )


def _merge(o1, lse1, o2, lse2):
    """Exact combination of two attention results over disjoint key sets (weights from their LSEs)."""
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1).to(o1.dtype)  # = e^lse1 / (e^lse1 + e^lse2)
    return o2 + (o1 - o2) * w1


def _runs(pos: list[int]) -> list[tuple[int, int]]:
    """Split sorted positions into [start, stop) index ranges of consecutive positions."""
    runs, begin = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((begin, i))
            begin = i
    return runs


def _blocks(pos: list[int]) -> list[tuple[int, int, bool]]:
    """Split queries into [start, stop) index blocks, flagged True when they are one causal run.

    Runs of consecutive positions are taken in order. A run joins the open block when the masked
    products it adds stay under MERGE_CELLS (the open block's queries over the run's span, the run's
    own triangle when it would have been causal alone, the block's when it was) and the block stays
    within QUERY_BLOCK queries; otherwise the block closes. A run of MIN_RUN or more opens a causal
    block, whatever its length. So scattered picks ride with the next run, a system prompt never joins
    a question 6K positions later, and two chunk starts hundreds of positions apart stay apart.
    """
    blocks: list[tuple[int, int, bool]] = []
    start, causal = 0, False
    for a, b in _runs(pos):
        if a > start:  # an open block [start, a)
            n, m = a - start, b - a
            added = n * (pos[b - 1] - pos[a - 1])                 # open queries over the run's span
            added += m * (m - 1) // 2 if m >= MIN_RUN else 0      # the run loses its causal kernel
            added += n * (n - 1) // 2 if causal else 0            # so does the open block
            if added <= MERGE_CELLS and n + m <= QUERY_BLOCK:
                causal = False
                continue
            blocks.append((start, a, causal))
        start, causal = a, b - a >= MIN_RUN
    if pos:
        blocks.append((start, len(pos), causal))
    return blocks


@dataclass(frozen=True)
class QueryBlock:
    start: int                  # query index range [start, stop)
    stop: int
    first: int                  # positions of its first and last query
    last: int
    mask: torch.Tensor | None   # additive [1, 1, G*B, last-first+1] for scattered blocks; None if contiguous


def plan_blocks(q_pos: torch.Tensor, groups: int, dtype: torch.dtype) -> list[QueryBlock]:
    """Blocks and in-block masks for `q_pos`; they depend only on positions, so layers share them."""
    pos = q_pos.tolist()
    plan = []
    for start, stop, contiguous in _blocks(pos):
        first, last = pos[start], pos[stop - 1]
        mask = None
        if not contiguous:
            key_pos = torch.arange(first, last + 1, device=q_pos.device)
            visible = key_pos.unsqueeze(0) <= q_pos[start:stop].unsqueeze(1)  # [B, span]
            # The CPU kernel takes an additive mask in the query dtype.
            mask = torch.zeros(visible.shape, dtype=dtype, device=q_pos.device).masked_fill_(~visible, float("-inf"))
            mask = mask.repeat(groups, 1).view(1, 1, groups * (stop - start), -1)
        plan.append(QueryBlock(start, stop, first, last, mask))
    return plan


def sparse_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    plan: list[QueryBlock] | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions `q_pos` over keys at positions 0..N-1.

    q: [T, Hq, D] (RoPE applied), k/v: [N, Hkv, D] where row i holds the key/value at global position i.
    q_pos: [T] strictly increasing int positions, each < N. A query at p sees keys j <= p, and with a
    sliding window only j > p - sliding_window (HF's convention). `plan` (from plan_blocks for the same
    q_pos, groups and dtype) saves rebuilding the blocks at every layer. Returns [T, Hq, D].
    """
    if q.device.type != "cpu" or (sliding_window is not None and sliding_window < k.shape[0]):
        # GPU kernels handle an explicit mask well; windowed layers are rare enough to take it too.
        return _dense_masked(q, k, v, q_pos, scale, sliding_window)
    kv_heads = k.shape[1]
    g = q.shape[1] // kv_heads
    kh, vh = _heads_first(k), _heads_first(v)
    out = torch.empty_like(q)
    for blk in plan if plan is not None else plan_blocks(q_pos, g, q.dtype):
        start, stop, first, last = blk.start, blk.stop, blk.first, blk.last
        qb = q[start:stop]
        qf = _fold_gqa(qb, kv_heads)
        span_k, span_v = kh[:, :, first : last + 1], vh[:, :, first : last + 1]
        if blk.mask is None:
            # Queries first..last see keys first..their own position: plain causal over the span.
            o_in, lse_in = _attend_with_lse(
                _heads_first(qb), span_k.repeat_interleave(g, dim=1), span_v.repeat_interleave(g, dim=1),
                None, scale, causal=True,
            )
            o_in = o_in.view(1, kv_heads, g, stop - start, -1).reshape(1, kv_heads, g * (stop - start), -1)
            lse_in = lse_in.reshape(1, kv_heads, g * (stop - start))
        else:
            o_in, lse_in = _attend_with_lse(qf, span_k, span_v, blk.mask, scale)
        if first > 0:
            # Everything before the block is visible to every query in it: no mask.
            o_pre, lse_pre = _attend_with_lse(qf, kh[:, :, :first], vh[:, :, :first], None, scale)
            o_in = _merge(o_pre, lse_pre, o_in, lse_in)
        out[start:stop] = _unfold_gqa(o_in, stop - start)
    return out


def _dense_masked(q, k, v, q_pos, scale, sliding_window):
    """Reference path: one SDPA call with an explicit [T, N] mask (GPU kernels handle it well)."""
    n = k.shape[0]
    key_pos = torch.arange(n, device=q.device)
    mask = key_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if sliding_window is not None:
        mask &= key_pos.unsqueeze(0) > (q_pos.unsqueeze(1) - sliding_window)
    g = q.shape[1] // k.shape[1]
    kh = _heads_first(k).repeat_interleave(g, dim=1)
    vh = _heads_first(v).repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(_heads_first(q), kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """One new query over every key before it: q [Hq, D] (the last position), k/v [Hkv, N, D]
    heads-first (KVCache.key_store rows) with the query's own key last. No mask and no copy of K/V:
    query heads are folded onto their KV head (HF's repeat_kv order), so one kernel call reads each
    key once. Returns [Hq, D].
    """
    kv_heads, n, d = k.shape
    if sliding_window is not None and sliding_window < n:
        k, v = k[:, n - sliding_window :], v[:, n - sliding_window :]  # keys j > p - window
    qf = q.view(1, kv_heads, -1, d)                                           # [1, Hkv, G, D]
    return F.scaled_dot_product_attention(qf, k.unsqueeze(0), v.unsqueeze(0), scale=scale).view(-1, d)
