"""Named offline rankers: which tokens of a chunk to recompute, decided once when the chunk is cached.

Every ranker maps a `ChunkView` (the chunk's tokens and the K/V it produced alone) to scores [N],
higher = more worth recomputing; the ranking is the scores' stable descending order. Names (specs):

- `lf[:alpha]`   the paper's low-frequency magnitude (CacheTune section 4.1), alpha default EngineConfig.alpha
- `lf_v0`        the public prototype's reading of it: layer-0 V only, cutoff 0.25, the chunk encoded after
                 a BOS token, and one top-r budget over the whole context instead of per chunk
- `highfreq[:alpha]`, `l2`, `random`  analysis controls (the frequencies `lf` drops, no filter, chance)
- `first` (alias `first_k`)  chunk order: at ratio r, the first r of every chunk (EPIC at equal budget)
- `probe[:n]`    K/V drift when the chunk is encoded after each of the first n probe prefixes
                 (cachetune.chunks.probes), averaged; `probe_head`: the prompt head alone as probe
- `a+b[+c]`      hybrid: reciprocal rank fusion of the named rankers (e.g. `first+probe`, `probe+lf`)

Rankers that run the model (`needs_model`) get the adapter and probe bank through the view's context.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from cachetune.chunks.probes import PROBE_PASSAGES, ProbeBank
from cachetune.chunks.ranking import (
    hf_scores,
    kv_drift,
    lf_scores,
    low_frequency,
    magnitude_scores,
    rank_fusion,
    ranking_from_scores,
    scores_from_ranking,
    seeded_permutation,
)
from cachetune.config import EngineConfig
from cachetune.model.adapter import ModelAdapter

# The default of EngineConfig.ranking: the ranker with the lowest KL to full recompute at r = 0.15
# across both models and datasets measured (docs/results.md, offline rankings). The probe finds more of the
# high-drift tokens, but position gave equal or better fidelity, at no offline cost.
DEFAULT_RANKER = EngineConfig.ranking


@dataclass
class RankingContext:
    """What model-running rankers need: the model and the engine's probe prefixes."""

    adapter: ModelAdapter
    probes: ProbeBank
    bos_id: int | None = None


@dataclass
class ChunkView:
    """A chunk as offline rankers see it: token ids [N] and its alone K (pre-RoPE) / V [L, N, Hkv, D]."""

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    context: RankingContext | None = None


class Ranker(ABC):
    name: str
    needs_model: bool = False    # runs the model (probe): needs view.context
    global_budget: bool = False  # its scores compare across chunks: select top r of the whole context

    @abstractmethod
    def scores(self, view: ChunkView) -> torch.Tensor:
        """float32 [N], higher first."""

    def ranking(self, view: ChunkView) -> torch.Tensor:
        return ranking_from_scores(self.scores(view))


class FunctionRanker(Ranker):
    """A ranker that reads only the stored K/V and token ids."""

    def __init__(self, name: str, fn: Callable[[ChunkView], torch.Tensor]):
        self.name, self._fn = name, fn

    def scores(self, view: ChunkView) -> torch.Tensor:
        return self._fn(view).float().cpu()


def _position_scores(view: ChunkView) -> torch.Tensor:
    return torch.arange(view.token_ids.numel(), 0, -1, dtype=torch.float32)


class PrototypeLFRanker(Ranker):
    """`lf_v0`: low-pass (cutoff 0.25) of layer-0 V with a BOS row in front, token magnitude.

    Layer-0 V is a projection of each token's embedding, so it does not depend on context: the BOS
    row matters only through the FFT along tokens. Raw magnitudes (no per-chunk normalisation) are
    comparable across chunks, so the selection is one global top r, as in the prototype."""

    name = "lf_v0"
    global_budget = True
    needs_model = True
    CUTOFF = 0.25

    def scores(self, view: ChunkView) -> torch.Tensor:
        v0 = view.values[0].flatten(1).float()  # [N, Hkv*D]
        ctx = view.context
        if ctx is not None and ctx.bos_id is not None:
            bos = torch.tensor([ctx.bos_id], device=ctx.adapter.device)
            _, _, bos_v = ctx.adapter.project_qkv(0, ctx.adapter.embed(bos))
            v0 = torch.cat([bos_v.flatten(1).float().to(v0.device), v0])
        low = low_frequency(v0, self.CUTOFF).norm(dim=1)
        return low[-view.token_ids.numel():].cpu()


class ProbeRanker(Ranker):
    """Drift of each token's K/V between the chunk alone and after each of the given probes, averaged.

    `probes` index the engine's ProbeBank: 0 is the prompt head alone, 1.. the head plus a passage."""

    needs_model = True

    def __init__(self, name: str, probes: list[int]):
        self.name, self.probes = name, probes

    def scores(self, view: ChunkView) -> torch.Tensor:
        ctx = view.context
        if ctx is None:
            raise ValueError(f"ranker {self.name!r} runs the model: the chunk view needs a RankingContext")
        if max(self.probes) >= len(ctx.probes):
            raise ValueError(f"ranker {self.name!r} needs {max(self.probes) + 1} probes; the bank has {len(ctx.probes)}")
        total = torch.zeros(view.token_ids.numel())
        for i in self.probes:
            k, v = (x.to(view.keys.device) for x in ctx.probes.after(i, view.token_ids))
            total += kv_drift(view.keys, view.values, k, v).cpu()
        return total / len(self.probes)


class FusionRanker(Ranker):
    def __init__(self, name: str, parts: list[Ranker]):
        self.name, self.parts = name, parts
        self.needs_model = any(p.needs_model for p in parts)

    def scores(self, view: ChunkView) -> torch.Tensor:
        return rank_fusion([p.scores(view) for p in self.parts])


def _alpha(text: str, default: float) -> float:
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0 or math.isnan(value):
        raise ValueError(f"alpha must be in (0, 1], got {_shown(text, 20)}")
    return value


# Probe prefixes a RankingContext holds: the prompt head alone (probe 0), then the head followed by
# each passage (the engine builds one per PROBE_PASSAGES entry), so `probe:n` takes n <= len(PROBE_PASSAGES).
MAX_PROBES = len(PROBE_PASSAGES)
MAX_FUSED = 8  # parts of a hybrid ("a+b+c"): one of each ranker at most is all that means anything


def _shown(text: str, limit: int = 40) -> str:
    """`text` for an error message, cut short (names come from requests)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _probe_count(text: str) -> int:
    """`probe:n`'s n, checked before anything is sized by it."""
    if not (text.isascii() and text.isdigit() and len(text) <= 3) or not 1 <= int(text) <= MAX_PROBES:
        raise ValueError(f"probe count must be an integer in [1, {MAX_PROBES}] (the probe passages there are), "
                         f"got {_shown(text, 20)}")
    return int(text)


def _with_alpha(base: str, alpha: float) -> str:
    # The name identifies the ranking a store holds, so a non-default cutoff is part of it.
    return base if alpha == EngineConfig.alpha else f"{base}:{alpha:g}"


def _simple(base: str, arg: str, alpha: float) -> Ranker | None:
    if base == "lf":
        a = _alpha(arg, alpha)
        return FunctionRanker(_with_alpha("lf", a), lambda v: lf_scores(v.keys, v.values, a))
    if base == "highfreq":
        a = _alpha(arg, alpha)
        return FunctionRanker(_with_alpha("highfreq", a), lambda v: hf_scores(v.keys, v.values, a))
    if arg:
        if base == "probe":
            count = _probe_count(arg)
            return ProbeRanker(f"probe:{count}", list(range(1, count + 1)))
        return None
    simple = {
        "l2": lambda: FunctionRanker("l2", lambda v: magnitude_scores(v.keys, v.values)),
        "random": lambda: FunctionRanker("random", lambda v: scores_from_ranking(seeded_permutation(v.token_ids))),
        "first": lambda: FunctionRanker("first", _position_scores),
        "first_k": lambda: FunctionRanker("first", _position_scores),
        "lf_v0": PrototypeLFRanker,
        "probe": lambda: ProbeRanker("probe", [1]),
        "probe_head": lambda: ProbeRanker("probe_head", [0]),
    }
    return simple[base]() if base in simple else None


RANKER_NAMES = ("lf", "lf_v0", "highfreq", "l2", "random", "first", "probe", "probe_head")


def get_ranker(spec: str, alpha: float = EngineConfig.alpha) -> Ranker:
    """The ranker named by `spec` (see the module doc); `alpha` is the default LF cutoff."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a ranker is named by a non-empty string, got {spec!r}; known: {', '.join(RANKER_NAMES)}")
    if spec.count("+") >= MAX_FUSED:  # counted before splitting: a long hybrid allocates nothing
        raise ValueError(f"a hybrid ranker fuses at most {MAX_FUSED} rankers, got {spec.count('+') + 1}")
    parts = spec.split("+")
    rankers = []
    for part in parts:
        base, _, arg = part.partition(":")
        try:
            ranker = _simple(base, arg, alpha)
        except ValueError as exc:
            raise ValueError(f"bad ranker {_shown(spec)}: {exc}") from None
        if ranker is None:
            raise ValueError(f"unknown ranker {_shown(part)}; known: {', '.join(RANKER_NAMES)}, "
                             "optionally 'name:arg' (lf/highfreq alpha, probe count), joined by '+' for a hybrid")
        rankers.append(ranker)
    if len(rankers) == 1:
        return rankers[0]
    if any(r.global_budget for r in rankers):
        raise ValueError(f"{spec!r}: a globally budgeted ranker cannot be fused per chunk")
    return FusionRanker("+".join(r.name for r in rankers), rankers)


def rank_tokens(spec: str, keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor,
                alpha: float = EngineConfig.alpha, context: RankingContext | None = None) -> torch.Tensor:
    """The ranking [N] of one chunk by the named ranker."""
    return get_ranker(spec, alpha).ranking(ChunkView(token_ids, keys, values, context))
