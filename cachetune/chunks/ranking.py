"""Offline token rankings of an independently encoded chunk (pure functions on tensors).

A ranking orders a chunk's local token indices, most worth recomputing first. `RANKERS` names every
ranking the harness compares: the paper's `lf`, and for analysis `highfreq` (the frequencies `lf`
drops), `l2` (no frequency filter), `random` and `first` (chunk order, EPIC-like).

`lf_scores` is CacheTune's low-frequency ranking (paper section 4.1 and appendix B.1): along the token
axis of every layer's K and V, per head and channel, keep the lowest `alpha` share of the rFFT
frequencies, invert to length N, take each token's magnitude of the low-frequency K and of V, combine
them with equal weights, normalise within the layer (divide by the layer's sum, so layers weigh
equally) and average over layers.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch


def low_frequency(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Low-pass along dim 0: x [N, ...] -> [N, ...] keeping ceil(alpha * (N//2 + 1)) frequencies."""
    n = x.shape[0]
    spectrum = torch.fft.rfft(x.float(), dim=0)
    keep = max(1, math.ceil(alpha * spectrum.shape[0]))
    spectrum[keep:] = 0
    return torch.fft.irfft(spectrum, n=n, dim=0)


def high_frequency(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """High-pass along dim 0: the complement of `low_frequency(x, alpha)` (x == low + high)."""
    return x.float() - low_frequency(x, alpha)


def _layer_normalised_mean(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Average over layers of per-token scores, each layer divided by its sum first."""
    total = torch.zeros_like(per_layer[0])
    for s in per_layer:
        total += s / s.sum().clamp_min(torch.finfo(s.dtype).tiny)
    return total / len(per_layer)


def magnitude_scores(
    keys: torch.Tensor, values: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """keys/values: [L, N, Hkv, D] pre-RoPE -> per-token score [N] (float32).

    Per layer: the norm of each token's (transformed) K and of its V, weighted equally, divided by the
    layer's sum; then the mean over layers. `transform` acts along tokens on [N, Hkv*D] (None: raw).
    """
    transform = transform or (lambda x: x.float())
    per_layer = []
    for k, v in zip(keys, values):
        k_mag = transform(k.flatten(1)).norm(dim=1)  # [N]
        v_mag = transform(v.flatten(1)).norm(dim=1)
        per_layer.append(0.5 * k_mag + 0.5 * v_mag)
    return _layer_normalised_mean(per_layer)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")


def lf_scores(keys: torch.Tensor, values: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """CacheTune's score: magnitude of the low-frequency reconstruction (keys/values [L, N, Hkv, D])."""
    _check_alpha(alpha)
    return magnitude_scores(keys, values, lambda x: low_frequency(x, alpha))


def hf_scores(keys: torch.Tensor, values: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """The paper's high-frequency control: magnitude of what `lf_scores` filters out."""
    _check_alpha(alpha)
    return magnitude_scores(keys, values, lambda x: high_frequency(x, alpha))


def seeded_permutation(token_ids: torch.Tensor) -> torch.Tensor:
    """A random ranking that is the same for the same chunk content (seeded by its token ids)."""
    digest = hashlib.sha256(token_ids.to(torch.int64).numpy().tobytes()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randperm(token_ids.numel(), generator=generator)


def ranking_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Token indices, highest score first; ties keep the earlier token first (deterministic)."""
    return torch.sort(scores, descending=True, stable=True).indices


def top_share(ranking: torch.Tensor, ratio: float) -> torch.Tensor:
    """The first round(ratio * N) ranked tokens as sorted local indices (ratio 0 -> none, 1 -> all)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    count = min(ranking.numel(), int(math.floor(ratio * ranking.numel() + 0.5)))
    return torch.sort(ranking[:count]).values


# name -> (keys [L,N,H,D], values, token_ids [N], alpha) -> ranking [N]
RANKERS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "lf": lambda k, v, ids, alpha: ranking_from_scores(lf_scores(k, v, alpha)),
    "highfreq": lambda k, v, ids, alpha: ranking_from_scores(hf_scores(k, v, alpha)),
    "l2": lambda k, v, ids, alpha: ranking_from_scores(magnitude_scores(k, v)),
    "random": lambda k, v, ids, alpha: seeded_permutation(ids),
    "first": lambda k, v, ids, alpha: torch.arange(ids.numel()),
}


def rank_tokens(name: str, keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor,
                alpha: float = 0.5) -> torch.Tensor:
    """The ranking of one chunk by the named ranker (see RANKERS).

    A name may carry its own cutoff, "lf:0.3", which overrides `alpha` (the alpha sweep uses it)."""
    base, _, own_alpha = name.partition(":")
    try:
        ranker = RANKERS[base]
        alpha = float(own_alpha) if own_alpha else alpha
    except (KeyError, ValueError):
        raise ValueError(f"unknown ranker {name!r}; known: {', '.join(RANKERS)} (optionally 'name:alpha')") from None
    return ranker(keys, values, token_ids, alpha)
