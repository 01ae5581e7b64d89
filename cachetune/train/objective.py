"""What the trained reuse methods minimise: the answer loss of a prompt laid out as it is served.

A method's `logits_fn(adapter, tokens, sample)` returns the answer-token logits over its own assembly
of the prompt (C2KV: compressed rows; KVLink: reused documents plus link tokens), differentiable in
its trained tokens only. Losses: "ce" cross-entropy on the answer tokens (the papers'); "kd" KL from
the full-context base model's next-token distribution at the answer positions; "ce+kd" their sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cachetune.chunks.kv import encode_kv
from cachetune.model.adapter import ModelAdapter

LOSSES = ("ce", "kd", "ce+kd")


@dataclass(frozen=True)
class Sample:
    """Token ids of one training prompt (all 1-D int64)."""

    head: torch.Tensor               # template start + system prompt (uncached text before the documents)
    documents: list[torch.Tensor]    # each tokenized alone, in prompt order
    question: torch.Tensor           # question + assistant header (uncached text after the documents)
    answer: torch.Tensor             # target tokens (answer + end-of-turn)

    @property
    def full(self) -> torch.Tensor:
        return torch.cat([self.head, *self.documents, self.question, self.answer])


LogitsFn = Callable[[ModelAdapter, torch.nn.Module, Sample], torch.Tensor]


@torch.no_grad()
def document_kv(adapter: ModelAdapter, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values [L, N, Hkv, D] of a document encoded alone (never with autograd:
    document tokens see no trainable parameter)."""
    return encode_kv(adapter, token_ids)


def rotate_layers(adapter: ModelAdapter, keys: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Pre-RoPE keys [L, N, Hkv, D] rotated at `positions` [N], one tensor per layer."""
    rope = adapter.rope_tables(positions.to(adapter.device))
    return [adapter.rotate(keys[i], *rope[info.rope_kind]) for i, info in enumerate(adapter.layer_info)]


@torch.no_grad()
def teacher_logits(adapter: ModelAdapter, sample: Sample) -> torch.Tensor:
    """The full-context base model's next-token logits [len(answer), vocab] at the answer positions."""
    full = sample.full.to(adapter.device)
    logits = adapter.model(input_ids=full[None], use_cache=False).logits[0].float()
    a = sample.answer.numel()
    return logits[-a - 1 : -1]


def sample_loss(adapter: ModelAdapter, tokens: torch.nn.Module, sample: Sample, logits_fn: LogitsFn,
                loss: str = "ce") -> torch.Tensor:
    """Mean loss per answer token of one sample (differentiable in `tokens` only)."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    logits = logits_fn(adapter, tokens, sample)
    target = sample.answer.to(logits.device)
    total = logits.new_zeros(())
    if "ce" in loss.split("+"):
        total = total + F.cross_entropy(logits, target)
    if "kd" in loss.split("+"):
        teacher = torch.log_softmax(teacher_logits(adapter, sample), dim=-1)
        total = total + F.kl_div(torch.log_softmax(logits, dim=-1), teacher, log_target=True, reduction="batchmean")
    return total


def build_sample(engine, drawn) -> Sample:
    """Tokens of a drawn example laid out as the engine serves it (documents end with the separator)."""
    from cachetune.eval.harness import DOCUMENT_SEPARATOR

    head, question = engine.template.segments(drawn.system, drawn.example.question)
    docs = [engine.tokenize(d + DOCUMENT_SEPARATOR) for d in drawn.documents]
    answer = torch.cat([engine.tokenize(drawn.example.answers[0]), torch.tensor([engine.eos_id()])])
    return Sample(head, docs, question, answer)
