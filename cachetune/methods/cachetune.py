"""CacheTune's selection, the engine's default method: a budget of round(ratio x chunk tokens) shared
among a request's chunks by an allocation (methods.allocation), picked by the offline ranking stored
with each chunk and, with the question signal, by where the request's question attends
(methods.signals).

    cachetune                         the engine's settings (EngineConfig: ranking, allocation, ...)
    cachetune:lf                      another offline ranking (chunks.rankers)
    cachetune:first:allocation=proportional:signal=none    each chunk's first r, no request-time pass
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.chunks.rankers import get_ranker
from cachetune.config import SIGNALS, EngineConfig
from cachetune.methods.allocation import ALLOCATIONS, SIGNAL_TOKENS, START_SHARE, allocate
from cachetune.methods.base import MAX_LAYERS, MAX_TOKENS, Method, check_int, check_ratio, register
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top
from cachetune.methods.signals import (PRICE_SCALE, SIGNAL_DTYPE, SIGNAL_DTYPES, SIGNAL_LAYERS, deep_focus_price,
                                      question_attention, signal_adapter)
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.prefill import Prefilled

ORDER = 30  # after the exact methods and APE: the default, then the other reuse methods

# Deep focus: the question's attention over every layer, half the budget on chunk starts and the rest
# by that attention with no cap per chunk, the pass in bfloat16 where that is fast. On Qwen2.5-1.5B
# MuSiQue it halves the gap to ProphetKV that 4 layers leave; it pays only where the pass is cheap
# beside the prefill (`deep_within`), where it lowered KL at about 1.08x `first`'s TTFT
# (docs/results.md, selection).
DEEP_START_SHARE = 0.5
DEEP_DTYPE = "auto"
# Short chunks: a request whose chunks average at most SHORT_CHUNKS tokens takes deep focus where its
# price over `first` is at most SHORT_WITHIN (deep_within elsewhere). On Qwen2.5-1.5B HotpotQA rows cut
# into 128, 256 and 512-token chunks (1.6K-token prompts, where deep focus costs 1.2-1.3x `first`) it
# lowered KL on the tuning rows at every length, and on the held-out rows at 128 tokens from 0.323 to
# 0.260 (F1 0.68 to 0.85 of full recompute's) at 4.3x full recompute's TTFT; on SmolLM2's 600-token
# MuSiQue passages it bought nothing for its price (docs/results.md, quality by chunk length).
SHORT_CHUNKS = 512
SHORT_WITHIN = 0.35


@dataclass(frozen=True)
class RankedSettings:
    """Everything a ranked selection reads (docs/methods.md, "How cachetune spends its budget")."""

    ratio: float = EngineConfig.ratio            # share of the request's chunk tokens recomputed
    ranking: str = EngineConfig.ranking          # offline ranker (cachetune.chunks.rankers)
    allocation: str = EngineConfig.allocation    # how the budget is shared among chunks (methods.allocation)
    start_share: float = START_SHARE             # starts, spread, focus: the budget's share on chunk starts
    signal: str = EngineConfig.signal            # online signal that picks within the allocation (SIGNALS)
    signal_layers: int = SIGNAL_LAYERS           # layers the question signal reads
    signal_tokens: int | None = SIGNAL_TOKENS    # spread, focus: at most this many signal picks per chunk (None: no cap)
    signal_dtype: str = SIGNAL_DTYPE             # dtype of the signal's pass (auto: bfloat16 where it is fast)
    deep_within: float | None = EngineConfig.deep_within  # focus: deep focus where it costs at most this over first
    short_chunks: int | None = SHORT_CHUNKS      # focus: chunks averaging at most this many tokens are short
    short_within: float = SHORT_WITHIN           # focus: deep_within for short chunks where it is larger

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        get_ranker(self.ranking)  # a clear error now rather than at the first request
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; known: {', '.join(ALLOCATIONS)}")
        if self.signal not in SIGNALS:
            raise ValueError(f"unknown signal {self.signal!r}; known: {', '.join(SIGNALS)}")
        check_ratio(self.start_share, "start_share")
        check_int("signal_layers", self.signal_layers, maximum=MAX_LAYERS)
        if self.signal_tokens is not None:
            check_int("signal_tokens", self.signal_tokens, minimum=0, maximum=MAX_TOKENS)
        if self.signal_dtype not in SIGNAL_DTYPES:
            raise ValueError(f"signal_dtype must be one of {', '.join(SIGNAL_DTYPES)}, got {self.signal_dtype!r}")
        if self.short_chunks is not None:
            check_int("short_chunks", self.short_chunks, minimum=0, maximum=MAX_TOKENS)
        if self.deep_within is not None and (isinstance(self.deep_within, bool) or not isinstance(
                self.deep_within, (int, float)) or not 0 <= self.deep_within <= 1):
            raise ValueError(f"deep_within must be a share in [0, 1] (0 or none: never), got {self.deep_within!r}")
        check_ratio(self.short_within, "short_within")
        if self.allocation == "focus" and self.signal == "none":
            raise ValueError("the focus allocation needs an online signal (signal="
                             + ", ".join(s for s in SIGNALS if s != "none") + ")")


class RankedSelector(TokenSelector):
    """Recompute round(ratio x chunk tokens) of a request's chunk tokens, shared among its chunks by
    `settings.allocation`, picked by the offline ranking `settings.ranking` and, with the question
    signal, by where the question attends. The ratio is the one the method passes per request; every
    other choice is in `settings` (RankedSettings).

    signal "none": the offline ranking picks every token; the same chunk recomputes the same tokens
    wherever it is placed and whatever the question (a ranker whose scores compare across chunks, the
    prototype's `lf_v0`, takes the top of the whole context under `proportional`). "question": the
    question's attention over the reused context in the first `signal_layers` layers (the pass in
    `signal_dtype`) scores the tokens; `spread` and `focus` first give `start_share` of the budget to
    every chunk's top-ranked tokens (its first tokens by the default `first` ranking) and let the
    question pick at most `signal_tokens` per chunk of the rest, the remainder of the chunk's share
    continuing its starts. `deep_within` (`focus` with the question; other selections ignore it): a
    request whose deep focus is predicted to cost at most this share of `first`'s prefill
    (methods.signals.deep_focus_price times the machine's price scale) takes it instead: every
    layer, DEEP_START_SHARE, no cap per chunk, DEEP_DTYPE (None or 0: never). A request whose chunks
    average at most `short_chunks` tokens takes it within `short_within` instead where that is larger
    (deep focus gains most where chunks are short; None or 0: no chunks are short). `drops_unselected`:
    the tokens not picked leave the prompt.
    """

    reads_ranking = True

    def __init__(self, settings: RankedSettings, name: str = "cachetune", drops_unselected: bool = False):
        self.settings, self.name, self.drops_unselected = settings, name, drops_unselected

    @property
    def ranker(self) -> str:
        return self.settings.ranking

    def prepare(self, adapter: ModelAdapter) -> None:
        if self.settings.signal == "question":  # cast the layers the pass reads now, not in a request's time
            signal_adapter(adapter, self.settings.signal_layers, self.settings.signal_dtype)
            if self.goes_deep:
                signal_adapter(adapter, adapter.num_layers, DEEP_DTYPE)

    @property
    def goes_deep(self) -> bool:
        """Whether some request may take deep focus (`deep_within` set, under focus and the question)."""
        s = self.settings
        return bool(s.deep_within) and s.signal == "question" and s.allocation == "focus"

    def deep(self, request: SelectionRequest, ratio: float) -> bool:
        """Whether this request takes deep focus: its pass over every layer is cheap beside its prefill
        (the predicted price times the machine's measured scale, PRICE_SCALE where it has none)."""
        if not self.goes_deep:
            return False
        s = self.settings
        limit = max(s.deep_within, s.short_within) if self.short(request) else s.deep_within
        scale = PRICE_SCALE if request.price_scale is None else request.price_scale
        return scale * deep_focus_price(request.adapter, request.layout, ratio, DEEP_DTYPE) <= limit

    def short(self, request: SelectionRequest) -> bool:
        """Whether this request's chunks are short: they average at most `short_chunks` tokens."""
        most, lengths = self.settings.short_chunks, [chunk.num_tokens for chunk in request.chunks]
        return bool(most) and bool(lengths) and sum(lengths) <= most * len(lengths)

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return self.choose(request, ratio)[0]

    def choose(self, request: SelectionRequest, ratio: float) -> tuple[list[torch.Tensor], Prefilled | None]:
        s = self.settings
        offline = [request.rankings.scores(chunk, s.ranking) for chunk in request.chunks]
        if not offline:  # nothing reused: no budget to share, no signal to pay for
            return [], None
        if s.signal == "none":
            comparable = request.rankings.ranker(s.ranking).global_budget
            if comparable and s.allocation == "proportional":  # one budget over the whole context
                return split_global_top(offline, ratio), None
            return allocate(offline, ratio, s.allocation, comparable, s.start_share), None
        layers, start_share, signal_tokens, dtype = s.signal_layers, s.start_share, s.signal_tokens, s.signal_dtype
        if self.deep(request, ratio):
            layers, start_share, signal_tokens, dtype = request.adapter.num_layers, DEEP_START_SHARE, None, DEEP_DTYPE
        # The pass's layers are kept: the prefill continues from them instead of loading them again.
        scores, prefilled = question_attention(request.adapter, request.layout, layers, request.pipeline,
                                               request.capacity, dtype)
        return allocate(scores, ratio, s.allocation, True, start_share, ranked=offline,
                        signal_tokens=signal_tokens), prefilled


@register("cachetune", RankedSettings, suffix="ranking",
          summary="the top `ratio` of each chunk by its offline ranking (cachetune:<ranking> picks one)")
def _cachetune(settings: RankedSettings) -> Method:
    return SelectiveMethod(RankedSelector(settings), settings)
