"""Selective recompute as a method: a token selector picks, per reused chunk, the tokens a request
recomputes in its new context; everything else is loaded from the store (or, for pruning
selectors, dropped). Every selector-based method (cachetune, cacheblend, epic, ...) is a
`SelectiveMethod` around one `TokenSelector`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cachetune.methods.allocation import global_top, request_budget
from cachetune.methods.base import Method, MethodContext, RankingSource
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import Prefill, Prefilled, pruned_prefill, selective_prefill
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.forward import FuseFn
from cachetune.runtime.loading import Pipeline
from cachetune.store.base import StoredChunk


@dataclass
class SelectionRequest:
    """What a selector may look at: the assembled prompt, the model, and offline rankings.

    `rankings.scores(chunk, name)` is the chunk's score vector by a named offline ranker
    (cachetune.chunks.rankers); the engine computes it once per chunk and keeps it.
    """

    layout: PromptLayout
    adapter: ModelAdapter
    rankings: RankingSource
    capacity: int = 0              # KV rows the prefill will allocate (prompt + decoding room)
    pipeline: Pipeline = Pipeline()  # how the request loads reused KV (a selector's own pass too)
    price_scale: float | None = None  # this machine's measured over predicted price (None: not calibrated)

    @property
    def chunks(self) -> list[StoredChunk]:
        return [seg.chunk for _, seg in self.layout.chunk_segments]


class TokenSelector(ABC):
    """Chooses, per chunk, the local token indices to recompute in the new context.

    Contract: `select` returns one sorted, duplicate-free int64 tensor per chunk (prompt order),
    each index in [0, chunk.num_tokens). By default everything not returned is loaded from the store
    and reused; a selector with `drops_unselected` instead removes the other tokens from the prompt.
    `ratio` is the share of chunk tokens budgeted for recompute; a selector may ignore it (full
    reuse, EPIC) but never exceeds a chunk's length. Online selectors (CacheBlend, ProphetKV) run
    model computation inside `select`; it counts toward the request's time to first token.
    """

    name: str
    reads_ranking: bool = False    # reads an offline ranking (callers compute it before timing)
    ranker: str | None = None      # which one (None: the engine's configured default)
    drops_unselected: bool = False

    @abstractmethod
    def select(self, request: SelectionRequest, ratio: float) -> list[torch.Tensor]: ...

    def choose(self, request: SelectionRequest, ratio: float) -> tuple[list[torch.Tensor], Prefilled | None]:
        """`select`, plus the cache of a pass the selector ran over the fully reused chunks, which the
        prefill continues from instead of loading those layers again (default: no pass, None)."""
        return self.select(request, ratio), None

    def prepare(self, adapter: ModelAdapter) -> None:
        """Untimed, idempotent work before the selector serves with `adapter` (a signal's cast
        layers); default none."""
        return None

    def fusion(self, request: SelectionRequest, selections: list[torch.Tensor]) -> FuseFn | None:
        """Optional: how recomputed K/V are blended with the stored ones (CacheSlide); None = replace."""
        return None


def split_global_top(scores: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Top round(ratio * total) tokens over all chunks together, returned per chunk (sorted, local).

    scores: one [N_i] tensor per chunk. Online methods select one shared budget across the context, so
    a chunk the query cares about can take more than `ratio` of its own tokens.
    """
    return global_top(scores, request_budget([s.numel() for s in scores], ratio))


class SelectiveMethod(Method):
    """Recompute what `selector` picks at the settings' ratio (0 for settings without one)."""

    def __init__(self, selector: TokenSelector, settings):
        self.selector = selector
        self.settings = settings
        self.name = selector.name

    @property
    def ratio(self) -> float:
        return getattr(self.settings, "ratio", 0.0)

    def prepare(self, ctx: MethodContext, chunk: StoredChunk) -> None:
        self.selector.prepare(ctx.adapter)
        if self.selector.reads_ranking:  # computed once per chunk and kept, so requests never pay it
            ctx.rankings.scores(chunk, self.selector.ranker)

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        request = SelectionRequest(layout, ctx.adapter, ctx.rankings, capacity, ctx.pipeline,
                                   ctx.price_scale() if ctx.price_scale is not None else None)
        selections, prefilled = self.selector.choose(request, self.ratio)
        if self.selector.drops_unselected:
            return pruned_prefill(ctx.adapter, layout, selections, capacity)
        fuse = self.selector.fusion(request, selections)
        return selective_prefill(ctx.adapter, layout, selections, capacity, ctx.pipeline, fuse=fuse,
                                 prefilled=prefilled)
