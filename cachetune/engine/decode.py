"""Decoding from a prefilled KVCache: sampling, the generation loop and teacher forcing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cachetune.engine.forward import forward_active
from cachetune.engine.kv_cache import KVCache
from cachetune.model.adapter import ModelAdapter


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0   # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """logits [vocab] -> token id (greedy, or temperature + nucleus sampling)."""
    if cfg.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    # The seeded generator lives on the CPU (same samples on every device): draw there.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def extend(adapter: ModelAdapter, cache: KVCache, token_ids: list[int]) -> torch.Tensor:
    """Append tokens after cache.length; returns their next-token logits [len, vocab] (float32)."""
    device = adapter.device
    start = cache.length
    pos = torch.arange(start, start + len(token_ids), device=device)
    cache.ensure_capacity(start + len(token_ids))
    # Only the new positions need RoPE tables; index them relative to `start`.
    tables = adapter.rope_tables(pos)
    rope = {kind: (_shifted(cos, start), _shifted(sin, start)) for kind, (cos, sin) in tables.items()}
    hidden = forward_active(adapter, adapter.embed(torch.tensor(token_ids, device=device)), pos, cache, rope)
    return adapter.logits(hidden)


class _shifted:
    """A table of rows for positions start.. indexed by absolute position (avoids a full-size table)."""

    def __init__(self, rows: torch.Tensor, start: int):
        self.rows, self.start = rows, start

    def __getitem__(self, pos: torch.Tensor) -> torch.Tensor:
        return self.rows[pos - self.start]


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
    `functools.partial(extend, adapter, cache)` or a PrefillResult's method-aware `extend`).
    `stop_when(ids)` ends generation early once it returns True (e.g. a complete first line when
    only the first line is scored). Returns the generated ids without the stop token."""
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    out: list[int] = []
    logits = first_logits
    while True:
        token = sample(logits, cfg, generator)
        if token in stop_ids:
            break
        out.append(token)
        if len(out) >= cfg.max_new_tokens or (stop_when is not None and stop_when(out)):
            break
        logits = step([token])[-1]
    return out
