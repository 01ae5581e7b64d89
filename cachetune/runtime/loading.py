"""Per-layer loading of the reuse complement into one staging buffer, overlapped with compute.

For every layer, the rows a request reuses from all its chunks land in one preallocated staging
buffer `[R, 2, Hkv, D]` (keys and values side by side, as every tier stores them):

- chunks stored in ranking order (`RankedSource`: every store tier) are read by rank ranges, grouped
  by tier (`RangeReader`): one gather per layer from a memory arena, one positioned read per chunk
  from disk, one pipelined round trip to Redis. When a selection is not a rank range (a control
  ranking, EPIC's first tokens) the covering range is read and one gather over the whole buffer
  keeps the reused rows;
- on CUDA the host part of the buffer is pinned and goes to the device with one async copy on a side
  stream, handed to the forward through an event;
- reused keys get one RoPE call for all rows, on the loading path (deferred RoPE) or in the forward.

So the tensor operations per layer do not grow with the number of chunks. While layer l computes,
layer l+1 is read: on CUDA a worker queues the whole layer on a side stream; on CPU the worker does
only the reads that wait on storage (file reads, Redis, a throttled medium), and gathers, copies and
RoPE stay on the forward's thread, since a second thread doing torch work would run a second OpenMP
team spinning on the same cores (measured: overlap then cost 70% more than it hid).
`Pipeline` switches each of these off for the paper's Table 4 ablation (`cachetune bench-pipeline`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

# read(layer, out): fill `out` [rows, 2, Hkv, D] with one layer of a planned list of rank ranges.
ReadFn = Callable[[int, torch.Tensor], None]
# rotate(layer, keys [R, Hkv, D]) -> the keys rotated at the positions of the loader's rows.
RotateFn = Callable[[int, torch.Tensor], torch.Tensor]


class LayerSource(Protocol):
    """Anything that reads one layer of some of its rows (a stored chunk: cachetune.store.StoredChunk)."""

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RangeReader(Protocol):
    """Reads rank ranges of many chunks of one tier together (one reader per tier)."""

    device: torch.device  # where rows are read to: the CPU for host tiers, the GPU for a GPU tier
    blocking: bool        # reads wait on storage (disk, network), not on the CPU: worth a thread on CPU

    def plan(self, spans: list[tuple["RankedSource", int, int]]) -> ReadFn:
        """Prepare reading rank rows [lo, hi) of each (chunk, lo, hi), in order, into consecutive rows
        of a buffer. The returned read(layer, out) fills `out` [sum(hi - lo), 2, Hkv, D] (contiguous,
        on `device`, the chunks' row_dtype) with a number of tensor operations that does not depend
        on len(spans); it raises the store's CorruptChunkError when a chunk can no longer be read."""


@runtime_checkable
class RankedSource(LayerSource, Protocol):
    """A chunk whose rows are stored in ranking order and read by rank ranges (store.StoredChunk)."""

    ranking: torch.Tensor       # [R] local row of each rank
    rank_of: torch.Tensor       # [R] rank of each local row
    row_dtype: torch.dtype      # dtype of the stored rows
    reader: RangeReader | None  # None: read with load_layer, one call per chunk


@dataclass(frozen=True)
class Pipeline:
    """How reused KV is loaded; each switch is one step of the paper's Table 4 ablation."""

    overlap: bool = True        # read layer l+1 while layer l computes (False: read every layer first)
    sparse: bool = True         # read only the reused rows (False: every row of each chunk, then drop)
    deferred_rope: bool = True  # rotate reused keys on the loading path (False: in the forward)


SEQUENTIAL = Pipeline(overlap=False, sparse=False, deferred_rope=False)  # the ablation's first row


class StagingPool:
    """Staging buffers reused across layers and requests (pinned host memory on CUDA machines).

    take() hands out a byte buffer of at least `nbytes` that no other loader holds; give() returns
    it. At most `keep` free buffers, the largest, are kept per (device, pinned)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: dict[tuple[str, bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
        with self._lock:
            free = self._free.setdefault((str(device), pinned), [])
            fits = [i for i, b in enumerate(free) if b.numel() >= nbytes]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=pinned)

    def give(self, buf: torch.Tensor, pinned: bool = False) -> None:
        with self._lock:
            free = self._free.setdefault((str(buf.device), pinned), [])
            free.append(buf)
            free.sort(key=torch.Tensor.numel, reverse=True)
            del free[self.keep:]


STAGING = StagingPool()


def as_rows(buf: torch.Tensor, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of byte buffer `buf` as contiguous rows [rows, 2, kv_heads, head_dim]."""
    return buf[: rows * 2 * kv_heads * head_dim * dtype.itemsize].view(dtype).view(rows, 2, kv_heads, head_dim)


@dataclass
class _Group:
    """The parts of one request that one RangeReader reads (reader None: load_layer per source)."""

    reader: RangeReader | None
    on_host: bool
    blocking: bool = False  # its reads wait on storage (disk, network, a throttled medium)
    spans: list = field(default_factory=list)  # (source, lo, hi) rank ranges, or (source, local indices)
    dest: list = field(default_factory=list)   # [n] cache rows of the staged rows, per span
    keep: list = field(default_factory=list)   # [n] the span's reused rows among the group's staged rows
    rows: int = 0
    read: ReadFn | None = None


class LayerLoader:
    """Implements forward.ReusedKV for a request: parts are (source, local indices, KV rows to fill).

    `kv_shape` is (layers, Hkv, D) of the model, `device` and `dtype` where and how the forward wants
    the rows. Use as a context manager: close() stops the worker and returns the staging buffers."""

    def __init__(
        self,
        parts: list[tuple[LayerSource, torch.Tensor, torch.Tensor]],
        kv_shape: tuple[int, int, int],
        device: torch.device,
        dtype: torch.dtype,
        pipeline: Pipeline = Pipeline(),
        pool: StagingPool = STAGING,
    ):
        self.num_layers, self.kv_heads, self.head_dim = kv_shape
        self.device, self.dtype, self.pipeline, self.pool = device, dtype, pipeline, pool
        parts = [p for p in parts if p[1].numel()]
        ranked = [p[0] for p in parts if isinstance(p[0], RankedSource)]
        dtypes = {s.row_dtype for s in ranked}
        self.staged_dtype = dtypes.pop() if len(dtypes) == 1 else dtype  # the rows as stored, if one kind
        self._groups = self._group(parts)
        self.rows = torch.cat([d for g in self._groups for d in g.dest]).to(device) if parts else \
            torch.empty(0, dtype=torch.int64, device=device)
        self._host_rows = sum(g.rows for g in self._groups if g.on_host)
        self._staged = sum(g.rows for g in self._groups)
        offsets, at = [], 0
        for g in self._groups:
            offsets.append(at)
            at += g.rows
        keep = torch.cat([k + off for g, off in zip(self._groups, offsets) for k in g.keep]) if parts else None
        gather = keep is not None and keep.numel() != self._staged
        self._keep = keep.to(device) if gather else None
        self._cuda = device.type == "cuda"
        self._rotate: RotateFn | None = None
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._copied: dict[int, torch.cuda.Event] = {}    # host slot -> its copy to the device is done
        self._consumed: dict[int, torch.cuda.Event] = {}  # slot -> the forward is done with it
        self._pending: dict[int, Future] = {}
        self._loaded: list | None = None
        # On CPU a worker only pays when some reads wait on storage: torch work on a second thread
        # would start a second OpenMP team that spins against the forward's for the same cores.
        worth = self._cuda or any(g.blocking for g in self._groups)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-load") if pipeline.overlap and parts and worth \
            else None
        self._stream = torch.cuda.Stream(device) if self._cuda and parts else None

    def _group(self, parts) -> list[_Group]:
        """Parts grouped by reader, device-resident tiers first; each chunk's rank range chosen."""
        groups: dict[int, _Group] = {}
        for source, local, dest in parts:
            ranked = isinstance(source, RankedSource) and source.row_dtype == self.staged_dtype
            reader = source.reader if ranked else None
            on_host = reader is None or reader.device.type == "cpu"
            group = groups.setdefault(id(reader), _Group(reader, on_host, bool(getattr(reader, "blocking", False))))
            local, dest = local.cpu(), dest.cpu()
            if reader is None:
                group.spans.append((source, local))
                group.dest.append(dest)
                group.keep.append(torch.arange(group.rows, group.rows + local.numel()))
                group.rows += local.numel()
                continue
            ranks = source.rank_of[local]
            order = torch.argsort(ranks)
            ranks = ranks[order]
            lo, hi = (int(ranks[0]), int(ranks[-1]) + 1) if self.pipeline.sparse else (0, int(source.ranking.numel()))
            group.spans.append((source, lo, hi))
            group.dest.append(dest[order])
            group.keep.append(group.rows + ranks - lo)
            group.rows += hi - lo
        ordered = sorted(groups.values(), key=lambda g: g.on_host)
        for g in ordered:
            if g.reader is not None:
                g.read = g.reader.plan(g.spans)
        return ordered

    def begin(self, rotate: RotateFn) -> bool:
        """forward.ReusedKV: called before layer(0). With deferred RoPE the loader rotates the keys
        itself and returns True; otherwise the forward rotates them."""
        self._rotate = rotate if self.pipeline.deferred_rope else None
        if self._stream is not None:  # what the forward's stream made so far (RoPE tables, indices) comes first
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._worker is not None and self._groups:  # layer 0 starts loading while the forward sets up
            job = (self._read, 0, 0) if self._cuda else (self._fetch, 0, 0, True)
            self._pending[0] = self._worker.submit(*job)
        return self._rotate is not None

    # ------------------------------------------------------------------------------------------ reads
    def _buffers(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(host rows, device rows or None) of a staging slot, taken from the pool on first use."""
        if slot not in self._slots:
            row = 2 * self.kv_heads * self.head_dim * self.staged_dtype.itemsize
            host = self.pool.take(self._host_rows * row, torch.device("cpu"), pinned=self._cuda)
            dev = self.pool.take(self._staged * row, self.device) if self._cuda else None
            self._slots[slot] = (host, dev)
        host, dev = self._slots[slot]
        shape = (self.kv_heads, self.head_dim, self.staged_dtype)
        return as_rows(host, self._host_rows, *shape), (as_rows(dev, self._staged, *shape) if dev is not None else None)

    def _fetch(self, layer: int, slot: int, blocking: bool | None = None) -> None:
        """Read the groups' rows of `layer` into the slot (only the blocking, or only the other
        groups, when `blocking` says so)."""
        host, staged = self._buffers(slot)
        staged = staged if staged is not None else host
        at = {True: 0, False: 0}  # next free row of the host / device part
        for g in self._groups:
            out = (host if g.on_host else staged)[at[g.on_host]: at[g.on_host] + g.rows]
            at[g.on_host] += g.rows
            if blocking is not None and g.blocking != blocking:
                continue
            if g.read is not None:
                g.read(layer, out)
            else:
                self._read_by_layer(g, layer, out)

    def _finish(self, layer: int, slot: int):
        """(keys, values, CUDA event or None) of a fetched slot: on the device, the reused rows
        kept, in the model dtype, keys rotated with deferred RoPE."""
        host, staged = self._buffers(slot)
        staged = staged if staged is not None else host
        if self._cuda and self._host_rows:
            staged[self._staged - self._host_rows:].copy_(host, non_blocking=True)
        kv = staged if self._keep is None else staged.index_select(0, self._keep)
        kv = kv if kv.dtype == self.dtype and kv.device == self.device else kv.to(self.device, self.dtype)
        k, v = kv[:, 0], kv[:, 1]
        if self._rotate is not None:
            k = self._rotate(layer, k)
        done = None
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record(self._stream)
            if self._host_rows:
                self._copied[slot] = done
        return k, v, done

    def _read(self, layer: int, slot: int):
        """Fetch and finish a layer (on CUDA on the side stream, ordered after the slot's last use)."""
        if slot in self._copied:
            self._copied.pop(slot).synchronize()  # this host slot's last copy to the device has left it
        if self._stream is None:
            self._fetch(layer, slot)
            return self._finish(layer, slot)
        with torch.cuda.stream(self._stream):
            if slot in self._consumed:
                self._stream.wait_event(self._consumed.pop(slot))  # the forward is done with this slot
            self._fetch(layer, slot)
            return self._finish(layer, slot)

    @staticmethod
    def _read_by_layer(group: _Group, layer: int, out: torch.Tensor) -> None:
        """Sources without a range reader (compressed views): one load_layer call each."""
        at = 0
        for source, local in group.spans:
            k, v = source.load_layer(layer, local)
            out[at: at + local.numel(), 0].copy_(k)
            out[at: at + local.numel(), 1].copy_(v)
            at += local.numel()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """forward.ReusedKV: layer `index`'s reused keys and values [R, Hkv, D], in `rows` order."""
        if not self._groups:
            empty = torch.empty(0, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        if not self.pipeline.overlap:
            if self._loaded is None:  # sequential: every layer is read before the first computes
                self._loaded = [self._read(layer, slot=layer) for layer in range(self.num_layers)]
            k, v, done = self._loaded[index]
        elif self._cuda:  # the worker queues whole layers on the side stream
            future = self._pending.pop(index, None)
            k, v, done = future.result() if future is not None else self._read(index, index % 2)
            if index + 1 < self.num_layers:
                consumed = torch.cuda.Event()  # the next slot held layer index - 1, whose use is queued by now
                consumed.record(torch.cuda.current_stream(self.device))
                self._consumed[(index + 1) % 2] = consumed
                self._pending[index + 1] = self._worker.submit(self._read, index + 1, (index + 1) % 2)
        else:  # on CPU the worker only waits on storage; the rest runs here, on the forward's cores
            slot = index % 2
            future = self._pending.pop(index, None)
            if future is not None:
                future.result()
            else:
                self._fetch(index, slot, blocking=True)
            if index + 1 < self.num_layers and self._worker is not None:
                self._pending[index + 1] = self._worker.submit(self._fetch, index + 1, (index + 1) % 2, True)
            self._fetch(index, slot, blocking=False)
            k, v, done = self._finish(index, slot)
        if done is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(done)
            # Made on the side stream, used on this one: keep the allocator from reusing them early.
            k.record_stream(consumer)
            v.record_stream(consumer)
        return k, v

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None
        if self._stream is not None:
            # The buffers go back to the pool: nothing queued on either stream may still use them.
            self._stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        for host, dev in self._slots.values():
            self.pool.give(host, pinned=self._cuda)
            if dev is not None:
                self.pool.give(dev)
        self._slots = {}
        self._loaded = None

    def __enter__(self) -> "LayerLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
