"""A request as the engine tracks it, and the summary `generate` returns."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cachetune.methods import Method, Prefill, PromptLayout
from cachetune.runtime.decode import SamplingConfig, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # queued: its KV does not fit yet, or the loop has not reached it
    RUNNING = "running"    # prefilled, decoding
    FINISHED = "finished"  # stop token or max_new_tokens
    ABORTED = "aborted"    # abort() ended it
    FAILED = "failed"      # its prefill or a callback raised; `error` says why


TokenCallback = Callable[["Request", int], None]
FinishCallback = Callable[["Request"], None]
StopRule = Callable[[list[int]], bool]  # output ids so far -> True ends the request (finish_reason "stop")


@dataclass(eq=False)
class Request:
    """One request. The engine's step loop owns and updates it; callers only read it.

    `rows` KV rows (the method's prompt rows + max_new_tokens) are reserved from the budget while it runs and returned
    the moment it ends. Times are `time.perf_counter()` seconds.

    A request `given_prefill` was prefilled by its caller (Engine.prefill, outside the loop and its
    budget): it reserves no rows, the loop samples its first token from that prefill and decodes it
    alone through `Prefill.extend`, and its cache is never handed to the method's `finish` (the
    caller keeps it)."""

    id: int
    prompt: PromptLayout
    method: Method
    sampling: SamplingConfig
    rows: int
    on_token: TokenCallback | None = None
    on_finish: FinishCallback | None = None
    stop: StopRule | None = None       # checked after every emitted token
    given_prefill: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    error: BaseException | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    computed_tokens: int = 0           # tokens that went through the layers in its prefill
    recomputed_tokens: int = 0         # of those, tokens of cached chunks
    token_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)  # per output id (sampling.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)  # per prompt token (echo)
    prefill: Prefill | None = field(default=None, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.total

    @property
    def ttft_ms(self) -> float | None:
        """Arrival (add_request) to the first sampled token, queueing included."""
        return None if self.first_token_at is None else (self.first_token_at - self.arrival) * 1000


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_ms: float            # add_request to the first sampled token
    prompt_tokens: int
    recomputed_tokens: int    # chunk tokens recomputed in context (all of them for full_recompute)
    computed_tokens: int      # all tokens that went through the layers during prefill
    method: str
    ratio: float
    finish_reason: str
