"""Sampling and single-request decoding: teacher forcing (`extend`) and the plain generation loop."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from cachetune.config import EngineConfig
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.forward import AttentionFn, forward_active
from cachetune.runtime.kv_cache import KVCache


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = EngineConfig.max_new_tokens
    temperature: float = 0.0   # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None    # seeds the request's own generator (same draws on every device)
    ignore_eos: bool = False   # decode exactly max_new_tokens (benchmarks)
    logprobs: int | None = None         # each generated token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token the method computes (echo)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be an integer >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")

    def generator(self) -> torch.Generator | None:
        """A fresh CPU generator for one request (None when greedy or unseeded)."""
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """logits [vocab] -> token id (greedy, or temperature + nucleus sampling).

    Safe for every accepted temperature and top_p: the logits are shifted so the largest is 0 and
    scaled in float64, so a tiny temperature sends every other token to -inf (greedy in effect)
    instead of overflowing, and the top token is always kept however small top_p is."""
    if cfg.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double()
    probs = torch.softmax((logits - logits.max()) / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p
        keep[0] = True  # a top_p below the top token's share keeps that token alone
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    # The seeded generator lives on the CPU (same samples on every device): draw there.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model and the `top` most likely tokens at its place."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits [T, vocab] -> the logprob of tokens [T] at each row, with the `top` best per row.

    Log-probabilities are the model's own (log-softmax of the raw logits), whatever the sampling
    temperature, as OpenAI and vLLM report them."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, vocab]
    chosen = logp.gather(1, tokens.view(-1, 1).to(logp.device)).flatten().tolist()
    best_p, best_i = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(int(t), lp, list(zip(i, p)))
            for t, lp, i, p in zip(tokens.tolist(), chosen, best_i.tolist(), best_p.tolist())]


@torch.no_grad()
def extend(adapter: ModelAdapter, cache: KVCache, token_ids: list[int], attention: AttentionFn | None = None
           ) -> torch.Tensor:
    """Append tokens after cache.length (positions continue from the last row's); returns their
    next-token logits [len, vocab] (float32). `attention`: the request's own rule (APE), if any."""
    device = adapter.device
    start, n = cache.length, len(token_ids)
    cache.ensure_capacity(start + n)
    first = cache.next_position()
    cache.positions[start:start + n] = torch.arange(first, first + n, device=cache.positions.device)
    rows = torch.arange(start, start + n, device=device)
    hidden = forward_active(adapter, adapter.embed(torch.tensor(token_ids, device=device)), rows, cache,
                            attention=attention)
    return adapter.logits(hidden)


@torch.no_grad()
def generate_tokens(
    step: Callable[[list[int]], torch.Tensor],
    first_logits: torch.Tensor,
    cfg: SamplingConfig,
    stop_ids: set[int],
    stop_when: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Sample from `first_logits`, then decode one token at a time until a stop id or the budget.

    step(ids) appends tokens to the request's cache and returns their logits [len, vocab] (e.g.
    `functools.partial(extend, adapter, cache)` or a Prefill's method-aware `extend`).
    `stop_when(ids)` ends generation early once it returns True (e.g. a complete first line when
    only the first line is scored). Returns the generated ids without the stop token."""
    generator = cfg.generator()
    out: list[int] = []
    logits = first_logits
    while True:
        token = sample(logits, cfg, generator)
        if token in stop_ids and not cfg.ignore_eos:
            break
        out.append(token)
        if len(out) >= cfg.max_new_tokens or (stop_when is not None and stop_when(out)):
            break
        logits = step([token])[-1]
    return out
