"""Block-Attention's student: the fine-tuned model over the whole prompt with a block mask.

The head, each document and the question + answer are blocks at consecutive positions: a token of the
head or of a document attends causally within its own block only, and the question and answer attend
to everything before them. With RoPE, attention within a block depends only on relative positions,
so this equals serving: every document encoded alone, keys re-rotated where it lands. Documents see
the trainable adapters here, so their forward runs with autograd (unlike C2KV's).
"""

from __future__ import annotations

import torch

from cachetune.blockattn.model import BlockAttentionModel
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.dense import dense_forward
from cachetune.train.objective import Sample


def block_mask(lengths: list[int], tail: int) -> torch.Tensor:
    """visible [T, T] for blocks of `lengths` (each causal within itself) then `tail` tokens that see all."""
    block = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((tail,), -1)])
    causal = torch.ones(block.numel(), block.numel(), dtype=torch.bool).tril()
    return causal & ((block[:, None] == block[None, :]) | (block[:, None] == -1))


def block_attention_logits(adapter: ModelAdapter, tuned: BlockAttentionModel, sample: Sample) -> torch.Tensor:
    """Next-token logits predicting tail[1:] (question + answer; the last len(answer) rows are the
    answer's). `adapter` is unused: the fine-tune runs on its own copy of the model."""
    own = tuned.adapter
    ids = sample.full.to(own.device)
    tail = sample.question.numel() + sample.answer.numel()
    visible = block_mask([sample.head.numel(), *(d.numel() for d in sample.documents)], tail).to(own.device)
    hidden = dense_forward(own, own.embed(ids), torch.arange(ids.numel(), device=own.device), visible)
    return own.logits(hidden[-tail : -1])
