"""The token-selector contract: which tokens of each reused chunk a request recomputes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from cachetune.store.base import StoredChunk


class TokenSelector(ABC):
    """Chooses, per chunk, the local token indices to recompute in the new context.

    Contract: `select` returns one sorted, duplicate-free int64 tensor per chunk (in the order given),
    each index in [0, chunk.num_tokens). Everything not returned is loaded from the store and reused.
    `ratio` is the share of each chunk's tokens the caller budgets for recompute; a selector may
    ignore it (full reuse) but must never exceed the chunk length.
    """

    name: str

    @abstractmethod
    def select(self, chunks: Sequence[StoredChunk], ratio: float) -> list[torch.Tensor]: ...
