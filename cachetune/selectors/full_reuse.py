"""Full reuse (r = 0): every chunk token comes from the store; only uncached text is computed."""

from __future__ import annotations

from typing import Sequence

import torch

from cachetune.selectors.base import TokenSelector
from cachetune.store.base import StoredChunk


class FullReuseSelector(TokenSelector):
    name = "full_reuse"

    def select(self, chunks: Sequence[StoredChunk], ratio: float) -> list[torch.Tensor]:
        return [torch.empty(0, dtype=torch.int64) for _ in chunks]
