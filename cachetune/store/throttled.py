"""A tier as if it were on slower media, for benchmarks and calibration.

Every read from a `ThrottledStore` takes at least `latency_s` per request to the medium plus its
bytes over `bandwidth`: the inner tier reads the rows (so they are the real rows), then the reader
sleeps out the rest. Sleeping holds no core and no GIL, as a device read does, so overlap with
compute behaves as it would on the real medium. Writes are not throttled (chunks are stored
offline, before the requests that are timed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.config import MEDIA as CONFIG_MEDIA, parse_medium
from cachetune.store.base import ChunkStore, StoredChunk


@dataclass(frozen=True)
class Medium:
    """What one read costs: `latency_s` per request plus bytes / `bandwidth` (bytes per second)."""

    bandwidth: float
    latency_s: float = 0.0

    def seconds(self, nbytes: int, reads: int = 1) -> float:
        return reads * self.latency_s + nbytes / self.bandwidth


    @classmethod
    def parse(cls, text: str) -> "Medium":
        """'hdd', 'ssd', 'nvme', '60MB/s' or '60MB/s+5ms' (config.parse_medium)."""
        return cls(*parse_medium(text))


MEDIA = {name: Medium(*cost) for name, cost in CONFIG_MEDIA.items()}  # the reference devices


def _wait_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class ThrottledReader:
    """RangeReader wrapper: the inner reader's rows, delivered no faster than the medium allows."""

    def __init__(self, inner, medium: Medium):
        self.inner, self.medium, self.device = inner, medium, inner.device
        self.blocking = True  # it waits out the medium

    def plan(self, spans):
        read_inner = self.inner.plan([(chunk.inner, lo, hi) for chunk, lo, hi in spans])
        seconds = self.medium.seconds(sum((hi - lo) * chunk.row_bytes for chunk, lo, hi in spans), len(spans))

        def read(layer: int, out: torch.Tensor) -> None:
            deadline = time.perf_counter() + seconds
            read_inner(layer, out)
            _wait_until(deadline)

        return read


class ThrottledChunk(StoredChunk):
    def __init__(self, inner: StoredChunk, store: "ThrottledStore"):
        self.inner, self.medium = inner, store.medium
        self.take_metadata(inner)
        self.reader = store.reader_for(inner.reader) if inner.reader is not None else None

    @cached_property
    def row_bytes(self) -> int:
        """Bytes of one row of one layer, K and V (from one row, read once, on first need)."""
        k, _ = self.inner.load_layer(0, self.inner.ranking[:1])
        return 2 * k[0].numel() * k.element_size()

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    @property
    def row_dtype(self) -> torch.dtype:
        return self.inner.row_dtype

    @property
    def rank_of(self) -> torch.Tensor:
        return self.inner.rank_of

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        deadline = time.perf_counter() + self.medium.seconds(indices.numel() * self.row_bytes)
        k, v = self.inner.load_layer(layer, indices)
        _wait_until(deadline)
        return k, v

    def encoded(self) -> EncodedChunk:
        deadline = time.perf_counter() + self.medium.seconds(self.num_layers * int(self.ranking.numel()) * self.row_bytes)
        chunk = self.inner.encoded()
        _wait_until(deadline)
        return chunk


class ThrottledStore(ChunkStore):
    """`inner` (any tier) read at the speed of `medium` (MEDIA["hdd"], or your own Medium)."""

    def __init__(self, inner: ChunkStore, medium: Medium):
        self.inner, self.medium = inner, medium
        self.shared, self.kind = inner.shared, inner.kind
        self._readers: dict[int, ThrottledReader] = {}

    @property
    def on_evict(self):
        return self.inner.on_evict  # the inner tier evicts: demotion in a chain goes through it

    @on_evict.setter
    def on_evict(self, callback) -> None:
        self.inner.on_evict = callback

    def reader_for(self, inner_reader) -> ThrottledReader:
        key = id(inner_reader)
        if key not in self._readers:
            self._readers[key] = ThrottledReader(inner_reader, self.medium)
        return self._readers[key]

    def put(self, chunk: EncodedChunk) -> None:
        self.inner.put(chunk)

    def get(self, chunk_id: str) -> ThrottledChunk | None:
        deadline = time.perf_counter() + self.medium.latency_s  # the metadata lookup is one read
        stored = self.inner.get(chunk_id)
        _wait_until(deadline)
        return self.tag(ThrottledChunk(stored, self)) if stored is not None else None

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None:
        self.inner.put_scores(chunk_id, ranker, scores)

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None:
        return self.inner.get_scores(chunk_id, ranker)

    def remove(self, chunk_id: str) -> None:
        self.inner.remove(chunk_id)

    def stats(self):
        return self.inner.stats()

    def __len__(self) -> int:
        return len(self.inner)
