"""Prompt layout: uncached text and cached chunks in order, with their global positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cachetune.runtime.loading import LayerSource


@dataclass(frozen=True)
class Segment:
    """A span of the prompt: uncached text (chunk is None) or a cached chunk's tokens.

    `chunk` is a stored chunk (`cachetune.store.StoredChunk`: its tokens, ranking and per-layer rows);
    the runtime sees it only through what it reads, so this layer does not import the stores."""

    token_ids: torch.Tensor  # [n] int64
    chunk: LayerSource | None = None

    @property
    def cached(self) -> bool:
        return self.chunk is not None


@dataclass
class PromptLayout:
    """Segments in prompt order; positions are assigned in that order, starting at 0."""

    segments: list[Segment]
    starts: list[int] = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.starts, pos = [], 0
        for seg in self.segments:
            self.starts.append(pos)
            pos += int(seg.token_ids.numel())
        self.total = pos
        if self.total == 0:
            raise ValueError("empty prompt")
        if self.segments[-1].cached:
            # The first output token is predicted from the last prompt position, which must be computed.
            raise ValueError("a prompt must end with uncached text (e.g. the question), not a cached chunk")

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([s.token_ids for s in self.segments])

    @property
    def chunk_segments(self) -> list[tuple[int, Segment]]:
        """(start position, segment) of every cached chunk, in prompt order."""
        return [(start, s) for start, s in zip(self.starts, self.segments) if s.cached]
