"""How one request's recompute budget is shared among its chunks (pure functions on tensors).

A request recomputes `budget = round(ratio * chunk tokens)` chunk tokens in all, whatever the
allocation. The allocation decides how many each chunk gets and which:

- `proportional`: chunk i gets its share of the budget in proportion to its length (largest
  remainders; CacheTune's per-chunk top r), its top tokens by the ranking;
- `spread`: a share `start_share` of the budget goes to every chunk's top tokens by its offline
  ranking, the same count for each (water-filled: a chunk shorter than its share gives the rest to
  the others); with the default `first` ranking those are the chunk's first tokens (`starts`). The
  remainder goes in proportion to what each chunk has left, picked within each chunk by the scores:
  the recomputed tokens stay spread over the prompt like the chunks are, so their attention costs
  what `first`'s does (an online signal's favourites sit late in the prompt, and a late token
  attends over more keys). `signal_tokens` caps the scores' picks per chunk; the rest of the chunk's
  share continues its starts;
- `focus`: `spread`, with the remainder shared in proportion to the scores' mass in each chunk (the
  sum of its scores over the tokens its starts leave) instead of its length: the question's
  attention says which chunks this request needs, while the tokens stay each chunk's starts and
  signal picks (scores must compare across chunks).

`global_top` takes the top of the whole context by scores that compare across chunks (CacheBlend's
and ProphetKV's shape, and an offline ranking that compares across chunks, `lf_v0`).

Drift sits at the start of every chunk whatever its length, which is why a per-chunk proportional
budget starves short chunks: `spread` and `focus` give every chunk its start.
"""

from __future__ import annotations

import math

import torch

from cachetune.config import ALLOCATIONS

START_SHARE = 0.8   # `spread`, `focus`: the budget's share spent on chunk starts (the lowest KL measured)
SIGNAL_TOKENS = 4   # `spread`, `focus`: at most this many of a chunk's tokens picked by the signal (so no one
                    # chunk takes the signal's whole share)


def request_budget(lengths: list[int], ratio: float) -> int:
    """round(ratio * total chunk tokens): the chunk tokens a request recomputes (half rounds up)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    return min(sum(lengths), int(math.floor(ratio * sum(lengths) + 0.5)))


def proportional_quotas(lengths: list[int], budget: int) -> list[int]:
    """Counts per chunk in proportion to `lengths`, summing to `budget` (largest remainders; ties go
    to the earlier chunk). Each count is at most its chunk's length."""
    total = sum(lengths)
    if budget < 0 or budget > total:
        raise ValueError(f"budget must be in [0, {total}], got {budget}")
    if total == 0:
        return [0] * len(lengths)
    exact = [budget * n / total for n in lengths]
    quotas = [int(math.floor(e)) for e in exact]
    order = sorted(range(len(lengths)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: budget - sum(quotas)]:
        quotas[i] += 1
    return quotas


def weighted_quotas(weights: list[float], caps: list[int], budget: int) -> list[int]:
    """Counts per chunk in proportion to `weights` (negative ones count as 0), each at most its cap,
    summing to `budget`: water-filled (a chunk whose share passes its cap keeps the cap and the others
    share the rest by their weights), then largest remainders (ties to the earlier chunk). Chunks with
    no weight take a share, by their caps, only when the weighted ones are full."""
    if budget < 0 or budget > sum(caps):
        raise ValueError(f"budget must be in [0, {sum(caps)}], got {budget}")
    weight = [max(0.0, float(w)) for w in weights]
    capped: set[int] = set()
    while True:
        free = [i for i, c in enumerate(caps) if c > 0 and i not in capped]
        left = budget - sum(caps[i] for i in capped)
        if free and sum(weight[i] for i in free) <= 0:  # only weightless chunks left: by their caps
            weight = [float(c) if i in free else w for i, (c, w) in enumerate(zip(caps, weight))]
        total = sum(weight[i] for i in free)
        exact = {i: left * weight[i] / total if total > 0 else 0.0 for i in free}
        over = {i for i in free if exact[i] > caps[i]}
        if not over:
            break
        capped |= over
    quotas = [caps[i] if i in capped else int(math.floor(exact[i])) if i in exact else 0 for i in range(len(caps))]
    order = sorted(exact, key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: budget - sum(quotas)]:
        quotas[i] += 1
    return quotas


def equal_quotas(lengths: list[int], budget: int) -> list[int]:
    """The same count per chunk, summing to `budget`; a chunk shorter than its share keeps all of its
    tokens and the others share the rest (water-filling). Leftover units go to the earlier chunks."""
    total = sum(lengths)
    if budget < 0 or budget > total:
        raise ValueError(f"budget must be in [0, {total}], got {budget}")
    quotas = [0] * len(lengths)
    left = budget
    open_ = [i for i, n in enumerate(lengths) if n > 0]
    while left > 0 and open_:
        share = max(1, left // len(open_))
        for i in list(open_):
            take = min(share, lengths[i] - quotas[i], left)
            quotas[i] += take
            left -= take
            if quotas[i] == lengths[i]:
                open_.remove(i)
            if left == 0:
                break
    return quotas


def top_by_score(scores: torch.Tensor, count: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """The `count` highest-scoring local indices (sorted), ties to the earlier token; `exclude` [N]
    bool marks indices that may not be taken."""
    s = scores.float().cpu().clone()
    if exclude is not None:
        s[exclude] = float("-inf")
    order = torch.sort(s, descending=True, stable=True).indices[:count]
    return torch.sort(order).values


def _fill(scores: list[torch.Tensor], quotas: list[int], taken: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Per chunk: the already taken indices plus its quota of the best others."""
    out = []
    for i, (s, q) in enumerate(zip(scores, quotas)):
        done = taken[i] if taken is not None else torch.empty(0, dtype=torch.int64)
        exclude = torch.zeros(s.numel(), dtype=torch.bool)
        exclude[done] = True
        extra = top_by_score(s, q, exclude)
        out.append(torch.sort(torch.cat([done, extra])).values)
    return out


def global_top(scores: list[torch.Tensor], count: int, taken: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """`count` more indices over all chunks together by score (scores must compare across chunks),
    added to `taken`; returned per chunk (sorted, local)."""
    lengths = [s.numel() for s in scores]
    if not scores:
        return []
    flat = torch.cat([s.float().cpu() for s in scores])
    exclude = torch.zeros(flat.numel(), dtype=torch.bool)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    if taken is not None:
        for i, t in enumerate(taken):
            exclude[t + offsets[i]] = True
    chosen = top_by_score(flat, count, exclude)
    out = []
    for i in range(len(scores)):
        local = chosen[(chosen >= offsets[i]) & (chosen < offsets[i + 1])] - offsets[i]
        done = taken[i] if taken is not None else torch.empty(0, dtype=torch.int64)
        out.append(torch.sort(torch.cat([done, local])).values)
    return out


def chunk_mass(scores: torch.Tensor, taken: torch.Tensor) -> float:
    """The sum of a chunk's scores [N] over the tokens not `taken` (its starts): how much of the
    signal falls on what the chunk has left to recompute."""
    left = torch.ones(scores.numel(), dtype=torch.bool)
    left[taken] = False
    return float(scores.float().cpu()[left].clamp(min=0).sum())


def starts(ranked: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`count` tokens in all, the same number of every chunk's top tokens by its offline scores
    `ranked` (water-filled: a chunk shorter than its share gives the rest to the others). By
    position scores (the `first` ranking) these are the chunks' first tokens."""
    return _fill(ranked, equal_quotas([s.numel() for s in ranked], count))


def start_count(budget: int, start_share: float) -> int:
    """How much of a budget `spread` and `focus` spend on chunk starts (half rounds up)."""
    if not 0.0 <= start_share <= 1.0:
        raise ValueError(f"start_share must be in [0, 1], got {start_share}")
    return int(math.floor(start_share * budget + 0.5))


def allocate(scores: list[torch.Tensor], ratio: float, allocation: str = "proportional",
             comparable: bool = False, start_share: float = START_SHARE,
             ranked: list[torch.Tensor] | None = None, signal_tokens: int | None = None) -> list[torch.Tensor]:
    """The chunk tokens to recompute: one sorted int64 tensor of local indices per chunk, round(ratio *
    chunk tokens) in all (see the module doc for each allocation).

    scores: one [N_i] vector per chunk, higher first; `comparable`: whether they compare across
    chunks (required by `focus`). ranked: the offline scores that pick the starts of `spread` and
    `focus` (default: `scores` when they do not compare across chunks, otherwise position).
    signal_tokens: under `spread` and `focus`, at most this many of a chunk's tokens go by `scores`
    and the rest of its share continues its starts by `ranked` (None: no cap)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; known: {', '.join(ALLOCATIONS)}")
    start_count(0, start_share)  # validates the share
    if signal_tokens is not None and signal_tokens < 0:
        raise ValueError(f"signal_tokens must be >= 0 (or None: no cap), got {signal_tokens}")
    lengths = [s.numel() for s in scores]
    budget = request_budget(lengths, ratio)
    if allocation == "proportional":
        return _fill(scores, proportional_quotas(lengths, budget))
    if allocation == "focus" and not comparable:
        raise ValueError("the focus allocation needs scores that compare across chunks (an online signal)")
    if ranked is None:
        ranked = [torch.arange(n, 0, -1, dtype=torch.float32) for n in lengths] if comparable else scores
    first = starts(ranked, start_count(budget, start_share))
    left = budget - sum(t.numel() for t in first)
    caps = [n - t.numel() for n, t in zip(lengths, first)]
    if allocation == "focus":
        rest = weighted_quotas([chunk_mass(s, t) for s, t in zip(scores, first)], caps, left)
    else:
        rest = proportional_quotas(caps, left)
    if signal_tokens is not None:
        more = [max(0, q - signal_tokens) for q in rest]
        first = _fill(ranked, more, taken=first)
        rest = [q - m for q, m in zip(rest, more)]
    return _fill(scores, rest, taken=first)
