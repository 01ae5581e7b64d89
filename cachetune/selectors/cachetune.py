"""CacheTune: recompute the top `ratio` of each chunk by its offline ranking (stored with the chunk)."""

from __future__ import annotations

from typing import Sequence

import torch

from cachetune.chunks.ranking import top_share
from cachetune.selectors.base import TokenSelector
from cachetune.store.base import StoredChunk


class RankedSelector(TokenSelector):
    """Query-independent: the same chunk recomputes the same tokens wherever it is placed."""

    name = "cachetune"

    def select(self, chunks: Sequence[StoredChunk], ratio: float) -> list[torch.Tensor]:
        return [top_share(chunk.ranking, ratio) for chunk in chunks]
