"""The cost model of a selective prefill (paper C.1): predicted TTFT at recompute ratio r.

A prompt of T tokens holds cached chunks of n_1..n_k tokens (N in all). At ratio r the forward
computes a(r) = T - N + sum_i round(r n_i) tokens (uncached text plus the recomputed ones) through L
layers, and reads the other N - sum_i round(r n_i) rows of every layer from the tier. Per layer:

    C(r) = t_o + a(r) (t_c + t_a T)        compute: fixed overhead, per token, attention over T
    B(r) = t_lo + k t_seek + rows(r) t_i   loading: fixed, per chunk read, per row (0 if no row)

    pipelined  TTFT = B + (L - 1) max(C, B) + C    layer l+1 loads while layer l computes
    sequential TTFT = L (B + C)                     (and any tier whose loading shares the forward's
                                                     cores: a CPU memory arena's gather)

C grows with r and B shrinks, so the pipelined optimum is where they cross (or r_min, when compute
already dominates there); the sequential one is an end of the interval. `model_optimum` is the
search's warm start.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import torch


def recomputed_count(tokens: int, ratio: float) -> int:
    """Tokens of one chunk a ratio recomputes: round(r n), as chunks.ranking.top_share counts them."""
    return min(tokens, int(math.floor(ratio * tokens + 0.5)))


@dataclass(frozen=True)
class PromptShape:
    """What the cost of one prompt depends on: its length and the lengths of its cached chunks."""

    tokens: int               # T
    chunks: tuple[int, ...]   # n_i

    def active(self, ratio: float) -> int:
        """Tokens the forward computes at `ratio`."""
        return self.tokens - sum(self.chunks) + sum(recomputed_count(n, ratio) for n in self.chunks)

    def reused(self, ratio: float) -> int:
        """Rows per layer read from the tier at `ratio`."""
        return self.tokens - self.active(ratio)


@dataclass(frozen=True)
class Profile:
    """Measured costs of one model, device, dtype and tier, in seconds (profile.profile_tier)."""

    layers: int
    t_o: float       # compute: fixed per layer
    t_c: float       # compute: per active token per layer
    t_a: float       # compute: per active token per prompt token per layer (attention)
    t_lo: float      # loading: fixed per layer
    t_seek: float    # loading: per chunk per layer (one positioned read, one round trip)
    t_i: float       # loading: per reused row per layer (bytes / bandwidth, copies, conversion)
    overlapped: bool  # the tier's reads run beside the forward (a blocking tier, or any tier on CUDA)

    def compute_s(self, shape: PromptShape, ratio: float) -> float:
        """C: one layer's forward at `ratio`."""
        return self.t_o + shape.active(ratio) * (self.t_c + self.t_a * shape.tokens)

    def load_s(self, shape: PromptShape, ratio: float) -> float:
        """B: one layer's reads at `ratio` (nothing when every row is recomputed)."""
        rows = shape.reused(ratio)
        return self.t_lo + len(shape.chunks) * self.t_seek + rows * self.t_i if rows else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def predict_ttft(profile: Profile, shape: PromptShape, ratio: float, pipelined: bool = True) -> float:
    """Predicted seconds to the first token's logits of one prompt at `ratio`."""
    c, b, n = profile.compute_s(shape, ratio), profile.load_s(shape, ratio), profile.layers
    if pipelined and profile.overlapped:
        return b + (n - 1) * max(c, b) + c
    return n * (b + c)


def mean_ttft(profile: Profile, shapes: list[PromptShape], ratio: float, pipelined: bool = True) -> float:
    return sum(predict_ttft(profile, s, ratio, pipelined) for s in shapes) / len(shapes)


def model_optimum(profile: Profile, shapes: list[PromptShape], lo: float, hi: float, pipelined: bool = True,
                  step: float = 0.0025) -> float:
    """The ratio in [lo, hi] with the lowest predicted mean TTFT over `shapes` (a grid of `step`:
    the model is piecewise linear in r, so the grid finds the crossing to within a step); ties go
    to the smaller ratio."""
    grid = [lo + i * step for i in range(int((hi - lo) / step) + 1)] + [hi]
    return min(grid, key=lambda r: (round(mean_ttft(profile, shapes, r, pipelined), 12), r))


def nonnegative_fit(features: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost is never negative): the best of the exact
    fits over every subset of features whose solution is non-negative (a handful of features)."""
    x, y = torch.tensor(features, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64)
    width = x.shape[1]
    best, best_err = [0.0] * width, float(y.square().sum())
    for size in range(1, width + 1):
        for cols in itertools.combinations(range(width), size):
            sol = torch.linalg.lstsq(x[:, cols], y[:, None]).solution.flatten()
            if bool((sol < 0).any()):
                continue
            err = float((x[:, cols] @ sol - y).square().sum())
            if err < best_err - 1e-18:
                best_err = err
                best = [0.0] * width
                for c, v in zip(cols, sol.tolist()):
                    best[c] = v
    return best
