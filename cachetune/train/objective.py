"""What the trained reuse methods minimise: the answer loss of a prompt laid out as it is served.

A method's `logits_fn(adapter, tokens, sample)` returns the next-token logits of the tail (question +
answer) after its first token over its own assembly of the prompt (C2KV: compressed rows; KVLink:
reused documents plus link tokens), differentiable in its trained tokens only; the last len(answer)
rows predict the answer. Losses: "ce" cross-entropy on the answer tokens (the papers'); "kd" KL from
the full-context base model's next-token distribution; "ce+kd" their sum. The KL covers the answer
positions (`kd_span="answer"`) or every tail position (`"tail"`: the question tokens read the
documents too, which gives distillation ~5x more targets per prompt than the short answers alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cachetune.chunks.kv import encode_kv
from cachetune.model.adapter import ModelAdapter

LOSSES = ("ce", "kd", "ce+kd")
KD_SPANS = ("answer", "tail")


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
    """The full-context base model's next-token logits predicting tail[1:] (as `logits_fn`)."""
    full = sample.full.to(adapter.device)
    logits = adapter.model(input_ids=full[None], use_cache=False).logits[0].float()
    tail = sample.question.numel() + sample.answer.numel()
    return logits[-tail:-1]


def sample_loss(adapter: ModelAdapter, tokens: torch.nn.Module, sample: Sample, logits_fn: LogitsFn,
                loss: str = "ce", kd_span: str = "answer", ce_weight: float = 1.0) -> torch.Tensor:
    """Mean loss per target token of one sample (differentiable in `tokens` only); in "ce+kd" the
    cross-entropy counts `ce_weight` times."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if kd_span not in KD_SPANS:
        raise ValueError(f"kd_span must be one of {KD_SPANS}, got {kd_span!r}")
    logits = logits_fn(adapter, tokens, sample)
    a = sample.answer.numel()
    total = logits.new_zeros(())
    if "ce" in loss.split("+"):
        ce = F.cross_entropy(logits[-a:], sample.answer.to(logits.device))
        total = total + (ce_weight * ce if loss == "ce+kd" else ce)
    if "kd" in loss.split("+"):
        rows = slice(-a, None) if kd_span == "answer" else slice(None)
        teacher = torch.log_softmax(teacher_logits(adapter, sample)[rows], dim=-1)
        student = torch.log_softmax(logits[rows], dim=-1)
        total = total + F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    return total


def build_sample(engine, drawn) -> Sample:
    """Tokens of a drawn example laid out as the engine serves it (documents end with the separator)."""
    head, question = engine.template.segments(drawn.system, drawn.example.question)
    docs = [engine.template.document(d) for d in drawn.documents]
    answer = torch.cat([engine.tokenize(drawn.example.answers[0]), torch.tensor([engine.eos_id()])])
    return Sample(head, docs, question, answer)
