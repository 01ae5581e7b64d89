"""Offline token rankings of an independently encoded chunk (pure functions on tensors).

`lf_scores` is CacheTune's low-frequency ranking (paper section 4.1 and appendix B.1): along the token
axis of every layer's K and V, per head and channel, keep the lowest `alpha` share of the rFFT
frequencies, invert to length N, take each token's magnitude of the low-frequency K and of V, combine
them with equal weights, normalise within the layer (divide by the layer's sum, so layers weigh
equally) and average over layers.
"""

from __future__ import annotations

import math

import torch


def low_frequency(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Low-pass along dim 0: x [N, ...] -> [N, ...] keeping ceil(alpha * (N//2 + 1)) frequencies."""
    n = x.shape[0]
    spectrum = torch.fft.rfft(x.float(), dim=0)
    keep = max(1, math.ceil(alpha * spectrum.shape[0]))
    spectrum[keep:] = 0
    return torch.fft.irfft(spectrum, n=n, dim=0)


def _layer_normalised_mean(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Average over layers of per-token scores, each layer divided by its sum first."""
    total = torch.zeros_like(per_layer[0])
    for s in per_layer:
        total += s / s.sum().clamp_min(torch.finfo(s.dtype).tiny)
    return total / len(per_layer)


def lf_scores(keys: torch.Tensor, values: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """keys/values: [L, N, Hkv, D] pre-RoPE -> importance score per token [N] (float32)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    per_layer = []
    for k, v in zip(keys, values):
        k_mag = low_frequency(k.flatten(1), alpha).norm(dim=1)  # [N]
        v_mag = low_frequency(v.flatten(1), alpha).norm(dim=1)
        per_layer.append(0.5 * k_mag + 0.5 * v_mag)
    return _layer_normalised_mean(per_layer)


def ranking_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Token indices, highest score first; ties keep the earlier token first (deterministic)."""
    return torch.sort(scores, descending=True, stable=True).indices


def top_share(ranking: torch.Tensor, ratio: float) -> torch.Tensor:
    """The first round(ratio * N) ranked tokens as sorted local indices (ratio 0 -> none, 1 -> all)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    count = min(ranking.numel(), int(math.floor(ratio * ranking.numel() + 0.5)))
    return torch.sort(ranking[:count]).values
