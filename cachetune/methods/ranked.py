"""Selectors that read an offline ranking (CacheTune, the analysis controls, LF-only pruning), EPIC's
first tokens and full reuse, and the methods built on them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachetune.chunks.rankers import get_ranker
from cachetune.config import SIGNALS, EngineConfig
from cachetune.methods.allocation import (ALLOCATIONS, PER_CHUNK, SIGNAL_TOKENS, START_SHARE, WITH_STARTS, allocate,
                                         request_budget, start_count, starts)
from cachetune.methods.base import (MAX_LAYERS, MAX_TOKENS, Method, NoSettings, RatioSettings, check_int, check_ratio,
                                    register)
from cachetune.runtime.prefill import Prefilled
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector
from cachetune.methods.signals import (DEVIATION_LAYER, PRICE_SCALE, SIGNAL_DTYPE, SIGNAL_DTYPES, SIGNAL_LAYERS,
                                      SIGNAL_POOL, attended_deviation, deep_focus_price, position_weighted,
                                      question_attention, signal_adapter, top_attended, value_deviation)

# Deep focus: the question's attention over every layer, half the budget on chunk starts and the rest
# by that attention with no cap per chunk, the pass in bfloat16 where that is fast. On Qwen2.5-1.5B
# MuSiQue it halves the gap to ProphetKV that 4 layers leave; it pays only where the pass is cheap
# beside the prefill (`deep_within`), where it lowered KL at about 1.08x `first`'s TTFT
# (docs/results.md, selection).
DEEP_START_SHARE = 0.5
DEEP_DTYPE = "auto"


class RankedSelector(TokenSelector):
    """Recompute round(ratio x chunk tokens) of a request's chunk tokens, shared among its chunks by
    `allocation` (methods.allocation), picked by the offline ranking stored with each chunk and, with
    a signal, by what the request itself shows.

    signal None: the offline ranking picks every token; the same chunk recomputes the same tokens
    wherever it is placed and whatever the question (a ranker whose scores compare across chunks, the
    prototype's `lf_v0`, allocates globally). With a signal, the `starts` allocation first gives
    `start_share` of the budget to every chunk's top-ranked tokens (its first tokens by the default
    `first` ranking), and the signal picks the rest over the whole context: "question", the
    question's attention over the reused context in the first `signal_layers` layers; "deviation",
    CacheBlend's layer-1 value deviation of the tokens the starts leave; "attended", the question's
    attention times that deviation, read on the `signal_pool` x (signal picks) tokens the question
    attends to most of those the starts leave (methods.signals). Under
    `spread` the signal picks at most `signal_tokens` per chunk (None: no cap) and the rest of the
    chunk's share continues its starts; `decay` weighs the question's scores down with the in-chunk
    position. `signal_max_chunk`: under a per-chunk allocation (PER_CHUNK), the signal picks only in
    chunks of at most this many tokens; a longer chunk's share goes by its offline ranking, and a
    request with no such chunk skips the signal's pass (None: every chunk). `signal_dtype`: the dtype
    the signal's passes run in (methods.signals.SIGNAL_DTYPES). `deep_within` (`focus` with the
    "question" signal; other selections ignore it): a request whose deep focus is predicted to cost at
    most this share of `first`'s prefill (methods.signals.deep_focus_price times the machine's price
    scale) takes it instead of the settings above: every layer, DEEP_START_SHARE, no cap per chunk,
    DEEP_DTYPE (None or 0: never). `ranker` None: the engine's default.
    """

    reads_ranking = True

    def __init__(self, name: str = "cachetune", ranker: str | None = None, drops_unselected: bool = False,
                 allocation: str = "proportional", start_share: float = START_SHARE, signal: str | None = None,
                 signal_layers: int = SIGNAL_LAYERS, decay: float = 0.0,
                 signal_tokens: int | None = SIGNAL_TOKENS, signal_max_chunk: int | None = None,
                 signal_pool: float = SIGNAL_POOL, signal_dtype: str = SIGNAL_DTYPE,
                 deep_within: float | None = None):
        self.name, self.ranker, self.drops_unselected = name, ranker, drops_unselected
        self.allocation, self.start_share = allocation, start_share
        self.signal, self.signal_layers, self.decay = signal, signal_layers, decay
        self.signal_tokens, self.signal_max_chunk, self.signal_pool = signal_tokens, signal_max_chunk, signal_pool
        self.signal_dtype, self.deep_within = signal_dtype, deep_within

    def prepare(self, adapter) -> None:
        if self.signal is not None:  # cast the layers the passes read now, not in a request's time
            deviation = DEVIATION_LAYER + 1  # the layers below the compared one, and its projection
            reads = {"question": self.signal_layers, "deviation": deviation}.get(
                self.signal, max(self.signal_layers, deviation))
            signal_adapter(adapter, reads, self.signal_dtype)
            if self.goes_deep:
                signal_adapter(adapter, adapter.num_layers, DEEP_DTYPE)

    @property
    def goes_deep(self) -> bool:
        """Whether some request may take deep focus (`deep_within` set, under focus and the question)."""
        return bool(self.deep_within) and self.signal == "question" and self.allocation == "focus"

    def deep(self, request: SelectionRequest, ratio: float) -> bool:
        """Whether this request takes deep focus: its pass over every layer is cheap beside its prefill
        (the predicted price times the machine's measured scale, PRICE_SCALE where it has none)."""
        if not self.goes_deep:
            return False
        scale = PRICE_SCALE if request.price_scale is None else request.price_scale
        return scale * deep_focus_price(request.adapter, request.layout, ratio, DEEP_DTYPE) <= self.deep_within

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return self.choose(request, ratio)[0]

    def choose(self, request: SelectionRequest, ratio: float) -> tuple[list[torch.Tensor], Prefilled | None]:
        offline = [request.rankings.scores(chunk, self.ranker) for chunk in request.chunks]
        if not offline:  # nothing reused: no budget to share, no signal to pay for
            return [], None
        if self.signal is None:
            comparable = request.rankings.ranker(self.ranker).global_budget
            allocation = "global" if comparable and self.allocation == "proportional" else self.allocation
            return allocate(offline, ratio, allocation, comparable, self.start_share), None
        signalled = self.signalled([s.numel() for s in offline])
        if not any(signalled):  # every chunk goes by its offline ranking: no pass to pay for
            return allocate(offline, ratio, self.allocation, False, self.start_share), None
        layers, start_share, signal_tokens, dtype = self.signal_layers, self.start_share, self.signal_tokens, \
            self.signal_dtype
        if self.deep(request, ratio):
            layers, start_share, signal_tokens, dtype = request.adapter.num_layers, DEEP_START_SHARE, None, DEEP_DTYPE
        prefilled = None
        if self.signal in ("question", "attended"):  # the pass's layers are kept: the prefill does not load them
            scores, prefilled = question_attention(request.adapter, request.layout, layers,
                                                   request.pipeline, request.capacity, dtype)
            scores = [position_weighted(s, self.decay) for s in scores]
        if self.signal in ("deviation", "attended"):  # read on the tokens the starts leave
            share = start_share if self.allocation in WITH_STARTS else 0.0
            budget = request_budget([s.numel() for s in offline], ratio)
            taken = starts(offline, start_count(budget, share))
            if self.signal == "deviation":  # every such token is a candidate
                candidates = []
                for t, s, keep in zip(taken, offline, signalled):
                    free = torch.ones(s.numel(), dtype=torch.bool)
                    free[t] = False
                    candidates.append(free.nonzero().flatten() if keep else torch.empty(0, dtype=torch.int64))
                scores = value_deviation(request.adapter, request.layout, candidates, pipeline=request.pipeline,
                                         dtype=dtype)
            else:  # a pool of the question's favourites, a few times what the signal may pick
                picks = budget - sum(t.numel() for t in taken)
                if picks:  # the starts take the whole budget: no deviation pass to pay for
                    candidates = top_attended(scores, taken, math.ceil(self.signal_pool * picks), signalled)
                    scores = attended_deviation(request.adapter, request.layout, scores, candidates,
                                                request.pipeline, dtype)
        # Per-chunk allocations fill each chunk from its own scores, so a chunk the signal skips can
        # take its offline ones (their scale never meets the signal's).
        scores = [s if keep else o for s, o, keep in zip(scores, offline, signalled)]
        return allocate(scores, ratio, self.allocation, True, start_share, ranked=offline,
                        signal_tokens=signal_tokens), prefilled

    def signalled(self, lengths: list[int]) -> list[bool]:
        """Which chunks (by token count) the signal may pick in."""
        if self.signal_max_chunk is None or self.allocation not in PER_CHUNK:
            return [True] * len(lengths)
        return [n <= self.signal_max_chunk for n in lengths]


class FirstTokensSelector(TokenSelector):
    """EPIC (LegoLink): recompute the first `k` tokens of every chunk, whatever the ratio.

    A chunk encoded alone turns its first tokens into attention sinks; recomputing them in context
    removes the spurious sinks. k=16 as in the CacheTune paper's EPIC setting.
    """

    name = "epic"

    def __init__(self, k: int = 16):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.arange(min(self.k, chunk.num_tokens)) for chunk in request.chunks]


class FullReuseSelector(TokenSelector):
    """Full reuse (r = 0): every chunk token comes from the store; only uncached text is computed."""

    name = "full_reuse"

    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]:
        return [torch.empty(0, dtype=torch.int64) for _ in request.chunks]


@dataclass(frozen=True)
class RankedSettings:
    ratio: float = EngineConfig.ratio            # share of the request's chunk tokens recomputed
    ranking: str = EngineConfig.ranking          # offline ranker (cachetune.chunks.rankers)
    allocation: str = EngineConfig.allocation    # how the budget is shared among chunks (methods.allocation)
    start_share: float = START_SHARE             # starts, spread, focus: the budget's share on chunk starts
    signal: str = EngineConfig.signal            # online signal that picks within the allocation (SIGNALS)
    signal_layers: int = SIGNAL_LAYERS           # layers the question signal reads
    decay: float = 0.0                           # question scores x (in-chunk position + 1)^-decay
    signal_tokens: int | None = SIGNAL_TOKENS    # spread, focus: at most this many signal picks per chunk (None: no cap)
    signal_max_chunk: int | None = None          # the signal picks only in chunks up to this length (None: all)
    signal_pool: float = SIGNAL_POOL             # attended: deviation read on this many times the signal's picks
    signal_dtype: str = SIGNAL_DTYPE             # dtype of the signal's passes (auto: bfloat16 where it is fast)
    deep_within: float | None = EngineConfig.deep_within  # focus: deep focus where it costs at most this over first

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        get_ranker(self.ranking)  # a clear error now rather than at the first request
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; known: {', '.join(ALLOCATIONS)}")
        if self.signal not in SIGNALS:
            raise ValueError(f"unknown signal {self.signal!r}; known: {', '.join(SIGNALS)}")
        check_ratio(self.start_share, "start_share")
        check_int("signal_layers", self.signal_layers, maximum=MAX_LAYERS)
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 <= self.decay <= 4:
            raise ValueError(f"decay must be a number in [0, 4], got {self.decay!r}")
        if self.signal_tokens is not None:
            check_int("signal_tokens", self.signal_tokens, minimum=0, maximum=MAX_TOKENS)
        if self.signal_max_chunk is not None:
            check_int("signal_max_chunk", self.signal_max_chunk, minimum=0, maximum=MAX_TOKENS)
        if isinstance(self.signal_pool, bool) or not isinstance(self.signal_pool, (int, float)) \
                or not 1 <= self.signal_pool <= 100:
            raise ValueError(f"signal_pool must be a number in [1, 100], got {self.signal_pool!r}")
        if self.signal_dtype not in SIGNAL_DTYPES:
            raise ValueError(f"signal_dtype must be one of {', '.join(SIGNAL_DTYPES)}, got {self.signal_dtype!r}")
        if self.deep_within is not None and (isinstance(self.deep_within, bool) or not isinstance(
                self.deep_within, (int, float)) or not 0 <= self.deep_within <= 1):
            raise ValueError(f"deep_within must be a share in [0, 1] (0 or none: never), got {self.deep_within!r}")
        if self.allocation == "focus" and self.signal == "none":
            raise ValueError("the focus allocation needs an online signal (signal="
                             + ", ".join(s for s in SIGNALS if s != "none") + ")")
        if self.allocation == "global" and self.signal == "none" and not get_ranker(self.ranking).global_budget:
            raise ValueError(f"the global allocation needs an online signal or a ranking that compares across "
                             f"chunks; {self.ranking!r} ranks each chunk alone")


@dataclass(frozen=True)
class EpicSettings:
    k: int = 16  # tokens recomputed at the start of every chunk (the CacheTune paper's EPIC setting)

    def __post_init__(self) -> None:
        check_int("k", self.k, minimum=0, maximum=MAX_TOKENS)


@register("cachetune", RankedSettings, suffix="ranking",
          summary="the top `ratio` of each chunk by its offline ranking (cachetune:<ranking> picks one)")
def _cachetune(settings: RankedSettings) -> Method:
    signal = None if settings.signal == "none" else settings.signal
    return SelectiveMethod(RankedSelector("cachetune", settings.ranking, allocation=settings.allocation,
                                          start_share=settings.start_share, signal=signal,
                                          signal_layers=settings.signal_layers, decay=settings.decay,
                                          signal_tokens=settings.signal_tokens,
                                          signal_max_chunk=settings.signal_max_chunk,
                                          signal_pool=settings.signal_pool,
                                          signal_dtype=settings.signal_dtype,
                                          deep_within=settings.deep_within), settings)


@register("full_reuse", summary="nothing but uncached text (r = 0)")
def _full_reuse(settings: NoSettings) -> Method:
    return SelectiveMethod(FullReuseSelector(), settings)


@register("epic", EpicSettings, summary="the first k tokens of every chunk")
def _epic(settings: EpicSettings) -> Method:
    return SelectiveMethod(FirstTokensSelector(settings.k), settings)


# Controls for the analysis: the same budget per chunk, other offline rankings.
for _control in ("random", "l2", "highfreq"):
    register(_control, RatioSettings, summary=f"control: the top `ratio` of each chunk by the `{_control}` ranking")(
        lambda settings, name=_control: SelectiveMethod(RankedSelector(name, name), settings))


@register("lf_only", RatioSettings, summary="control: keep the low-frequency top `ratio` of each chunk, drop the rest")
def _lf_only(settings: RatioSettings) -> Method:
    return SelectiveMethod(RankedSelector("lf_only", "lf", drops_unselected=True), settings)
