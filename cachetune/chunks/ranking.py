"""Offline token rankings of an independently encoded chunk (pure functions on tensors).

A ranking orders a chunk's local token indices, most worth recomputing first; a score vector [N]
(higher first) defines one. The named rankers built from these functions live in
cachetune.chunks.rankers.

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

from cachetune.config import EngineConfig

NOISE_FLOOR = 1e-5  # a layer whose total K (or V) drift is below this share of its total norm: no drift


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


def lf_scores(keys: torch.Tensor, values: torch.Tensor, alpha: float = EngineConfig.alpha) -> torch.Tensor:
    """CacheTune's score: magnitude of the low-frequency reconstruction (keys/values [L, N, Hkv, D])."""
    _check_alpha(alpha)
    return magnitude_scores(keys, values, lambda x: low_frequency(x, alpha))


def hf_scores(keys: torch.Tensor, values: torch.Tensor, alpha: float = EngineConfig.alpha) -> torch.Tensor:
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


def layer_drift(alone: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """alone/moved: [L, N, Hkv, D] -> raw per-layer, per-token L2 distance [L, N] (float32)."""
    return (moved.float() - alone.float()).flatten(2).norm(dim=2)


def _normalise_drift(drift: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """drift [L, N] divided by each layer's sum; layers at the noise floor become 0."""
    total = drift.sum(dim=1, keepdim=True)  # [L, 1]
    scale = moved.float().flatten(2).norm(dim=2).sum(dim=1, keepdim=True)
    live = total > NOISE_FLOOR * scale
    return torch.where(live, drift / total.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(drift))


def kv_drift(alone_k: torch.Tensor, alone_v: torch.Tensor, moved_k: torch.Tensor, moved_v: torch.Tensor) -> torch.Tensor:
    """Per-token drift [N] between two encodings of the same chunk tokens (all inputs [L, N, Hkv, D]).

    Per layer, each token's K (before RoPE) and V distance, divided by the layer's sum so layers weigh
    equally; K and V halves averaged, then the mean over layers. A layer part whose total drift is at
    the float noise floor counts 0 (layer 0's K/V are projections of the embeddings alone and cannot
    move). The drift analysis compares alone vs full prompt; the probe ranker alone vs after a probe.
    """
    k = _normalise_drift(layer_drift(alone_k, moved_k), moved_k)
    v = _normalise_drift(layer_drift(alone_v, moved_v), moved_v)
    return (0.5 * k + 0.5 * v).mean(dim=0)


def scores_from_ranking(ranking: torch.Tensor) -> torch.Tensor:
    """Scores [N] whose ranking_from_scores is `ranking` (the first ranked token scores N, the last 1)."""
    n = ranking.numel()
    scores = torch.empty(n, dtype=torch.float32)
    scores[ranking] = torch.arange(n, 0, -1, dtype=torch.float32)
    return scores


def rank_fusion(scores: list[torch.Tensor], k: float = 60.0) -> torch.Tensor:
    """Reciprocal rank fusion of several score vectors [N]: sum of 1 / (k + rank) (rank 1 = best).

    Rank-based, so components on different scales (drift shares, magnitudes, positions) mix without
    weights to tune; k=60 is the usual constant from the information-retrieval literature."""
    fused = torch.zeros_like(scores[0], dtype=torch.float32)
    for s in scores:
        rank = torch.empty(s.numel(), dtype=torch.float32)
        rank[ranking_from_scores(s)] = torch.arange(1, s.numel() + 1, dtype=torch.float32)
        fused += 1.0 / (k + rank)
    return fused
