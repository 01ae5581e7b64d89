"""Warm-started golden-section search for the ratio with the lowest measured TTFT (paper C.2).

    result = golden_section(ttft_of, lo=0.15, hi=1.0, start=0.31, eps=0.025)

The bracket is `width` wide around `start` (the cost model's optimum), clipped to [lo, hi]. Its two
ends and two golden points are the initial probes; while the lowest of them is an end that is not a
limit, the minimum lies beyond the golden point next to it: the bracket then runs from that point
`width` further that way (never back; up to three new probes a move). Then
every iteration keeps the side of the lower probe and reuses the other probe, so it costs one new
evaluation, until the bracket is narrower than `eps`. The answer is the bracket's midpoint, or a limit when that limit
measured the lowest TTFT of all probes (on a fast tier: exactly `lo`, the quality floor; measured
TTFT is noisy, and two close interior probes compared the wrong way must not walk the bracket off a
limit that was clearly best). `lo` is never crossed: the objective is not evaluated below it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

PHI = (math.sqrt(5) - 1) / 2  # 0.618...


@dataclass
class SearchResult:
    ratio: float                            # the chosen ratio
    bracket: tuple[float, float]            # the final interval
    probes: list[tuple[float, float]] = field(default_factory=list)  # (ratio, objective) in evaluation order


def golden_section(objective: Callable[[float], float], lo: float, hi: float, start: float,
                   eps: float = 0.025, width: float = 0.3) -> SearchResult:
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"need 0 <= lo < hi <= 1, got lo={lo}, hi={hi}")
    if eps <= 0 or width <= 0:
        raise ValueError("eps and width must be > 0")
    seen: dict[float, float] = {}
    result = SearchResult(lo, (lo, hi))

    def f(r: float) -> float:
        r = round(min(max(r, lo), hi), 6)
        if r not in seen:
            seen[r] = float(objective(r))
            result.probes.append((r, seen[r]))
        return seen[r]

    start = min(max(start, lo), hi)
    width = min(width, hi - lo)
    a = min(max(lo, start - width / 2), hi - width)
    b = a + width
    moved = 0  # -1 once the bracket moved down, +1 up: it never turns back
    while True:
        x1, x2 = b - PHI * (b - a), a + PHI * (b - a)
        fa, fb, f1, f2 = f(a), f(b), f(x1), f(x2)
        best = min(fa, fb, f1, f2)
        # Unimodal: an end below both golden points puts the minimum beyond that point, so the
        # next bracket starts at it (keeping the end) and reaches `width` further.
        if fa == best and a > lo and moved <= 0:
            b = x1
            a, moved = max(lo, b - width), -1
        elif fb == best and b < hi and moved >= 0:
            a = x2
            b, moved = min(hi, a + width), 1
        else:
            break
    while b - a > eps:
        if f1 <= f2:  # the minimum is in [a, x2]
            b, x2, f2 = x2, x1, f1
            x1 = b - PHI * (b - a)
            f1 = f(x1)
        else:         # the minimum is in [x1, b]
            a, x1, f1 = x1, x2, f2
            x2 = a + PHI * (b - a)
            f2 = f(x2)
    lowest = min(seen.values())
    result.bracket = (a, b)
    if seen.get(round(lo, 6)) == lowest:
        result.ratio = lo
    elif seen.get(round(hi, 6)) == lowest:
        result.ratio = hi
    else:
        result.ratio = (a + b) / 2
    return result
