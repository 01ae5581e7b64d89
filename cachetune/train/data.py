"""Training data for the trained reuse methods: HotpotQA with a fixed held-out split.

`hotpotqa/dev_subsampled.jsonl` (500 rows, 10 paragraphs each, 2 labelled supporting) is the only
set the data README allows training on. A fixed permutation (seed `split_seed`) puts the first
`heldout` rows into the held-out split, which training never reads; the rest train. Every training
step draws its own layout: both supporting paragraphs plus a random number of distractors, in random
order, so an extractor cannot learn one composition. Draws are a pure function of (seed, step): a
resumed run sees exactly the documents an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.engine.prompt import DEFAULT_SYSTEM
from cachetune.eval.datasets import HELDOUT, SPLIT_SEED, TRAIN_SET, QAExample, load_split, split_examples  # noqa: F401
# System prompts drawn per training step (the paper samples them from a small pool); the first is the
# one requests use by default, so serving sees a prompt training knows.
SYSTEM_POOL = (
    DEFAULT_SYSTEM,
    "Use the passages to answer the question. Reply with the answer only.",
    "Read the documents and answer the question briefly, with no explanation.",
)


@dataclass(frozen=True)
class Draw:
    example: QAExample
    documents: list[str]  # in prompt order
    system: str


def draw(examples: list[QAExample], seed: int, step: int, index: int = 0) -> Draw:
    """The `index`-th example of training step `step`: random row, supporting documents plus a random
    number of distractors (0 to all), shuffled, and a system prompt from the pool."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + index)
    example = examples[int(torch.randint(len(examples), (1,), generator=g))]
    docs = list(range(len(example.documents)))
    support = [d for d in docs if d in example.supporting] or docs[:1]
    others = [d for d in docs if d not in support]
    keep = int(torch.randint(len(others) + 1, (1,), generator=g))
    chosen = support + [others[i] for i in torch.randperm(len(others), generator=g)[:keep].tolist()]
    order = [chosen[i] for i in torch.randperm(len(chosen), generator=g).tolist()]
    system = SYSTEM_POOL[int(torch.randint(len(SYSTEM_POOL), (1,), generator=g))]
    return Draw(example, [example.documents[d] for d in order], system)


def heldout_draw(example: QAExample) -> Draw:
    """A held-out example as served: every document in dataset order, the default system prompt."""
    return Draw(example, list(example.documents), SYSTEM_POOL[0])
