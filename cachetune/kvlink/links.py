"""KVLink's link tokens: a few trained tokens after every reused document that restore cross-document
attention without recomputing the documents.

After each cached document the prompt gets `count` (5) link tokens with learned embeddings. They are
computed at request time like uncached text: causal, so they see the prompt head, every earlier
document and link, and their own document, whose KV is reused unchanged (full reuse, keys re-rotated
where the document lands). The question then reads the documents and the links. The links take
positions of their own: document i starts `count * i` positions later than without links.

Here the base model stays frozen and only the link embeddings train (the KVLink paper fine-tunes the
whole model; training it is out of reach of this project's CPUs), with the same objective and loop as
C2KV's extractor. The links use the model's own projections, so serving needs no new layer code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.c2kv.tokens import TrainedTokens
from cachetune.model.adapter import ModelAdapter

FORMAT = "cachetune-kvlink-links/1"


@dataclass(frozen=True)
class LinkConfig:
    count: int = 5  # link tokens after every document

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an integer >= 1, got {self.count!r}")


class LinkTokens(TrainedTokens):
    """embedding: [count, hidden], every row the EOS token's embedding at step 0."""

    FORMAT = FORMAT
    CONFIG = LinkConfig
    VARIANT = "kvlink"
    STEP0 = {"step0": LinkConfig()}
    OWN_PROJECTIONS = False

    def __init__(self, adapter: ModelAdapter, config: LinkConfig, base_identity: str, eos_id: int):
        super().__init__(adapter, config, base_identity, eos_id, count=config.count)


def link_layout(segment_lengths: list[int], cached: list[bool], count: int):
    """Rows of a prompt with `count` links after every cached segment, all at consecutive positions.

    Returns (reused [(segment index, first row)] for cached segments, link_rows [k*count] and
    text_rows [(segment index, first row)] for uncached ones, total rows)."""
    reused, links, text, row = [], [], [], 0
    for i, (n, is_cached) in enumerate(zip(segment_lengths, cached)):
        (reused if is_cached else text).append((i, row))
        row += n
        if is_cached:
            links.append(torch.arange(row, row + count))
            row += count
    return reused, torch.cat(links) if links else torch.empty(0, dtype=torch.int64), text, row
