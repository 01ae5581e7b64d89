"""Per-layer loading of the reuse complement, overlapped with compute of the previous layer.

While layer l computes, layer l+1's reused K/V are read from their tier (only the rows that are not
recomputed). On CPU a worker thread does the reading (torch releases the GIL in copies and gathers);
on CUDA the copy runs on a side stream and hands off through an event, as in the paper's pipeline.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch


class LayerSource(Protocol):
    """Anything that reads one layer of some of its rows (a stored chunk: cachetune.store.StoredChunk)."""

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerLoader:
    """Implements forward.ReusedKV for a request: parts are (source, local indices, KV rows to fill)."""

    def __init__(
        self,
        parts: list[tuple[LayerSource, torch.Tensor, torch.Tensor]],
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
        prefetch: bool = True,
    ):
        self.parts = [p for p in parts if p[1].numel()]
        self.num_layers = num_layers
        self.device = device
        self.dtype = dtype
        empty = torch.empty(0, dtype=torch.int64)
        self.rows = torch.cat([p[2] for p in self.parts]).to(device) if self.parts else empty.to(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-load") if prefetch and self.parts else None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and self._pool else None
        self._pending: dict[int, Future] = {}

    def _read(self, layer: int):
        ks, vs = [], []
        for chunk, local, _ in self.parts:
            k, v = chunk.load_layer(layer, local)
            ks.append(k)
            vs.append(v)
        k, v = torch.cat(ks), torch.cat(vs)
        if self._stream is None:
            return k.to(self.device, self.dtype), v.to(self.device, self.dtype), None
        with torch.cuda.stream(self._stream):
            if k.device.type == "cpu":  # pinned host memory makes the copy truly asynchronous
                k, v = k.pin_memory(), v.pin_memory()
            k = k.to(self.device, self.dtype, non_blocking=True)
            v = v.to(self.device, self.dtype, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return k, v, done

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        future = self._pending.pop(index, None)
        k, v, done = future.result() if future is not None else self._read(index)
        if self._pool is not None and index + 1 < self.num_layers:
            self._pending[index + 1] = self._pool.submit(self._read, index + 1)
        if done is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(done)
            # Made on the side stream, used on this one: keep the allocator from reusing them early.
            k.record_stream(consumer)
            v.record_stream(consumer)
        return k, v

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "LayerLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
