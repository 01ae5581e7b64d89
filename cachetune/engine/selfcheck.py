"""Start-up correctness gate: selective prefill must match the model's own forward.

Run once per engine on a short prompt. Two layouts are compared with the plain forward:
(1) template text + two chunks + question with every chunk token recomputed (r = 1), which exercises
the layer driver, RoPE at shifted positions and the sparse attention; (2) one chunk at position 0 with
nothing recomputed (r = 0), which exercises stored pre-RoPE K/V, deferred RoPE and loading. If either
disagrees, reuse is refused: an unsupported architecture or RoPE variant must never produce garbage.
"""

from __future__ import annotations

import torch

from cachetune.chunks.encode import encode_chunk
from cachetune.errors import CachetuneError
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.loading import Pipeline
from cachetune.store.memory import MemoryStore

# Relative tolerance on the logits (max abs diff / max abs logit) per dtype.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 2e-2}


class ReuseRefusedError(CachetuneError, RuntimeError):
    """Selective prefill disagreed with the plain forward; only full_recompute is allowed."""


def _relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6))


@torch.no_grad()
def run_self_check(adapter: ModelAdapter, fingerprint: str, vocab_size: int) -> float:
    """Raise ReuseRefusedError if selective prefill deviates; return the worst relative error."""
    gen = torch.Generator().manual_seed(1234)
    rand = lambda n: torch.randint(3, vocab_size, (n,), generator=gen)  # noqa: E731 - skip special ids
    store = MemoryStore()
    a = encode_chunk(adapter, rand(150), fingerprint)
    b = encode_chunk(adapter, rand(90), fingerprint)
    store.put(a)
    store.put(b)
    ca, cb = store.get(a.chunk_id), store.get(b.chunk_id)
    prefix, suffix = rand(7), rand(5)
    cases = [
        (PromptLayout([Segment(prefix), Segment(a.token_ids, ca), Segment(b.token_ids, cb), Segment(suffix)]),
         [torch.arange(a.num_tokens), torch.arange(b.num_tokens)]),
        (PromptLayout([Segment(a.token_ids, ca), Segment(suffix)]), [torch.empty(0, dtype=torch.int64)]),
    ]
    tol = TOLERANCE.get(adapter.dtype, 1e-2)
    worst = 0.0
    for i, (layout, selections) in enumerate(cases):
        ref = full_prefill(adapter, layout, layout.total).logits
        got = selective_prefill(adapter, layout, selections, layout.total, pipeline=Pipeline(overlap=False)).logits
        err = _relative_error(ref, got)
        worst = max(worst, err)
        if not err <= tol:  # also catches NaN
            raise ReuseRefusedError(
                f"self-check {i + 1} failed for model type {adapter.config.model_type!r}: selective prefill "
                f"differs from the model's own forward (relative error {err:.2e} > {tol:.0e}); "
                "KV reuse is refused for this model, use method='full_recompute'"
            )
    return worst
