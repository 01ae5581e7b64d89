"""Disk tier: one chunk blob (store.blob) per file, verified before use, written atomically, read by
positioned reads.

Nothing is memory-mapped: a file truncated or rewritten under a live store can only make a read come
up short (a CorruptChunkError), never crash the process. A handle is re-verified whenever the file's
inode, size or modification time differ from the ones it was verified with; and every range read is
verified by its block sums (store.blob, range verification), so a file rewritten in place that keeps
its size and mtime is caught too: the read raises CorruptChunkError, counts in `errors` and drops the
handle, so the next `get` verifies the whole file again (and deletes it). Files are opened without
following symlinks and must be regular files (a FIFO planted in the folder cannot hang a read).
Temp files of writers that died mid-write are removed when a store opens the folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from cachetune.chunks.encode import EncodedChunk
from cachetune.lru import LRUDict
from cachetune.store.base import ChunkStore, CorruptChunkError
from cachetune.store.blob import (FORMAT, ID_PATTERN, MAX_HEADER, BlobChunk, BlobMeta, ModelShape, check_id, pack, pack_scores,
                                  verify, verify_scores)

__all__ = ["FORMAT", "DiskChunk", "DiskStore"]
log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
SCORES_SUFFIX = ".scores"  # <chunk id>.<ranker tag>.scores: another ranker's scores of the chunk
STALE_TMP_S = 3600.0  # a temp file this old is garbage even if its writer's pid is alive (reused pids)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def byte_view(out: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor `out`, writable in place."""
    return memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(bytearray())


def read_exact(fd: int, offset: int, view: memoryview | list[memoryview]) -> None:
    """Fill `view` (or the views of a list, one after the other) with the file's bytes at `offset`
    (a short read is corruption)."""
    views = [v for v in (view if isinstance(view, list) else [view]) if len(v)]
    total, done = sum(len(v) for v in views), 0
    while views:
        n = os.preadv(fd, views, offset + done)
        if n <= 0:
            raise CorruptChunkError(f"truncated: {total - done} bytes missing at offset {offset + done}")
        done += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


class DiskReader:
    """runtime.loading.RangeReader of disk chunks: one positioned read per chunk per layer, straight
    into the staging buffer (no tensor operation per chunk), verified by block sums: the range is
    widened to block boundaries, the extra rows read into small side buffers in the same preadv."""

    device = torch.device("cpu")
    blocking = True

    def __init__(self, store: "DiskStore | None" = None):
        self.store = store
        self.bytes_read = 0

    def read_into(self, chunk: "DiskChunk", layer: int, lo: int, hi: int, view: memoryview) -> None:
        """Rank rows [lo, hi) of `layer` of `chunk` into `view`, verified; CorruptChunkError (counted
        in the store's errors, the handle dropped) when the file no longer holds the verified rows."""
        lay = chunk.layout
        a, b = lay.covering(lo, hi)
        offset, length = lay.span(layer, a, b)
        head, tail = bytearray((lo - a) * lay.row_bytes), bytearray((b - hi) * lay.row_bytes)  # the widening
        parts = [memoryview(head), view, memoryview(tail)]
        try:
            read_exact(chunk.fileno(), offset, parts)
            lay.check(layer, a, b, parts)
        except CorruptChunkError as exc:
            if self.store is not None:
                self.store.bad_range(chunk, exc)
            raise CorruptChunkError(f"{chunk.path}: {exc}") from None
        self.bytes_read += length

    def plan(self, spans):
        def read(layer: int, out: torch.Tensor) -> None:
            view, at = byte_view(out), 0
            for chunk, lo, hi in spans:
                length = (hi - lo) * chunk.layout.row_bytes
                self.read_into(chunk, layer, lo, hi, view[at: at + length])
                at += length

        return read


class DiskChunk(BlobChunk):
    """A verified chunk file, held open (one descriptor, no mapping) for positioned reads of its rows."""

    def __init__(self, path: Path, fd: int, identity: tuple, meta: BlobMeta, reader: DiskReader):
        self._fd = -1  # owned only once construction has succeeded (the opener closes it otherwise)
        super().__init__(meta)
        self.path, self.identity, self.reader = path, identity, reader
        self._fd = fd

    def fileno(self) -> int:
        if self._fd < 0:
            raise CorruptChunkError(f"{self.path}: closed")
        return self._fd

    def read_rows(self, layer: int, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank rows [lo, hi) of `layer` as [hi - lo, 2, Hkv, D] (into `out` when given): one read,
        verified (DiskReader.read_into)."""
        self.layout.span(layer, lo, hi)  # bounds
        lay = self.layout
        out = torch.empty(hi - lo, 2, lay.kv_heads, lay.head_dim, dtype=lay.dtype) if out is None else out
        self.reader.read_into(self, layer, lo, hi, byte_view(out))
        return out

    def load_layer(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rank_of[indices.cpu()]
        lo, hi = (int(rows.min()), int(rows.max()) + 1) if rows.numel() else (0, 0)
        # Only the covering rank range is read: the whole request for a ranked complement.
        kv = self.read_rows(layer, lo, hi).index_select(0, rows - lo)
        return kv[:, 0], kv[:, 1]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class DiskStore(ChunkStore):
    """Chunks under `root/<fingerprint prefix>/`, so several models can share one directory.

    At most `max_bytes` of files (None: no budget), least recently used evicted first; the recency
    of files found when the store opens is their modification time. Verified handles are kept for
    the `max_open` most recently used chunks (one file descriptor each); a chunk past that is
    verified again on its next use. `shape` (layers, KV heads, head size) is checked against every
    file when given."""

    shared = True
    kind = "disk"

    def __init__(self, root: str | Path, fingerprint: str, max_open: int = 256, shape: ModelShape | None = None,
                 max_bytes: int | None = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        self.fingerprint, self.shape, self.max_bytes = fingerprint, shape, max_bytes
        self.root = Path(root) / fingerprint[:16]
        self.reader = DiskReader(self)
        self.errors = 0  # range reads that failed their block sums, or came up short
        self.root.mkdir(parents=True, exist_ok=True)
        self._verified: LRUDict[str, DiskChunk] = LRUDict(max_open)
        self._lock = threading.Lock()
        self.removed_temp_files = self._remove_stale_temp_files()
        self._sizes: OrderedDict[str, int] = OrderedDict(self._scan())  # chunk id -> bytes, oldest first

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk files this store knows of."""
        return sum(self._sizes.values())

    def _scan(self) -> list[tuple[str, int]]:
        found = []
        for path in self.root.glob("*.safetensors"):
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if ID_PATTERN.fullmatch(path.stem) and stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime_ns, path.stem, st.st_size))
        return [(cid, size) for _, cid, size in sorted(found)]

    def path(self, chunk_id: str) -> Path:
        return self.root / f"{check_id(chunk_id)}.safetensors"

    def _remove_stale_temp_files(self) -> int:
        """Delete temp files whose writer is gone (pid not alive on this host) or that are old."""
        removed = 0
        for tmp in self.root.glob(f"*{TMP_SUFFIX}"):
            parts = tmp.name.split(".")
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            try:
                old = time.time() - tmp.lstat().st_mtime > STALE_TMP_S
            except FileNotFoundError:
                continue
            if pid is None or old or not _alive(pid):
                tmp.unlink(missing_ok=True)
                removed += 1
        return removed

    def put(self, chunk: EncodedChunk) -> None:
        target = self.path(chunk.chunk_id)
        if target.exists():
            with self._lock:
                if chunk.chunk_id in self._sizes:
                    self._sizes.move_to_end(chunk.chunk_id)
            return
        blob = pack(chunk, self.fingerprint)
        self._write(target, chunk.chunk_id, blob)
        evicted = []
        with self._lock:
            self._sizes[chunk.chunk_id] = len(blob)
            self._sizes.move_to_end(chunk.chunk_id)
            total = self.nbytes
            while self.max_bytes is not None and len(self._sizes) > 1 and total > self.max_bytes:
                cid, size = self._sizes.popitem(last=False)
                evicted.append(cid)
                total -= size
        for cid in evicted:
            self._evict(cid)

    def _evict(self, chunk_id: str) -> None:
        if self.on_evict is not None:
            try:
                stored = self.get(chunk_id)
            except CorruptChunkError:
                stored = None
            if stored is not None:
                self.on_evict(stored)
        self.remove(chunk_id)

    def _write(self, target: Path, chunk_id: str, blob: bytes) -> None:
        tmp = self.root / f"{chunk_id}.{os.getpid()}.{time.monotonic_ns()}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)  # atomic: readers see no file or the whole new one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, chunk_id: str) -> DiskChunk | None:
        path = self.path(chunk_id)
        try:
            now = _identity(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            self._verified.pop(chunk_id, None)
            with self._lock:
                self._sizes.pop(chunk_id, None)
            return None
        with self._lock:
            if chunk_id in self._sizes:
                self._sizes.move_to_end(chunk_id)
            else:  # written by another process sharing the folder
                self._sizes[chunk_id] = now[2]
        cached = self._verified.get(chunk_id)
        if cached is not None and cached.identity == now:
            self.hits += 1
            return self.tag(cached)
        self._verified.pop(chunk_id, None)  # changed since it was verified (or never was)
        try:
            stored = self._open_verified(path, chunk_id)
        except CorruptChunkError:
            _discard(path)
            with self._lock:
                self._sizes.pop(chunk_id, None)
            raise
        self._verified.put(chunk_id, stored)
        self.hits += 1
        return self.tag(stored)

    def bad_range(self, chunk: DiskChunk, exc: CorruptChunkError) -> None:
        """A range of a verified chunk failed (rewritten or truncated under us): count it, and drop the
        handle so the next `get` verifies the whole file again (deleting it if it is bad)."""
        with self._lock:
            self.errors += 1
            if self._verified.get(chunk.chunk_id) is chunk:
                self._verified.pop(chunk.chunk_id)
        log.warning("disk chunk %s: %s; dropped its verified handle", chunk.path, exc)

    def _open_verified(self, path: Path, expected_id: str) -> DiskChunk:
        """Open (regular files only, no symlink), read whole, check everything (store.blob.verify)."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:  # a symlink (ELOOP), vanished, unreadable
            raise CorruptChunkError(f"{path}: cannot open as a chunk file ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptChunkError(f"{path}: not a regular file")
            blob = bytearray(st.st_size)
            n = os.preadv(fd, [blob], 0) if st.st_size else 0
            if n != st.st_size:
                raise CorruptChunkError(f"{path}: short read ({n} of {st.st_size} bytes)")
            try:
                meta = verify(blob, self.fingerprint, expected_id, self.shape)
            except CorruptChunkError as exc:
                raise CorruptChunkError(f"{path}: {exc}") from None
            return DiskChunk(path, fd, _identity(st), meta, self.reader)
        except BaseException:
            os.close(fd)
            raise

    def scores_path(self, chunk_id: str, ranker: str) -> Path:
        tag = hashlib.sha256(ranker.encode()).hexdigest()[:16]
        return self.root / f"{check_id(chunk_id)}.{tag}{SCORES_SUFFIX}"

    def put_scores(self, chunk_id: str, ranker: str, scores: torch.Tensor) -> None:
        if self.path(chunk_id).exists():
            self._write(self.scores_path(chunk_id, ranker), chunk_id, pack_scores(chunk_id, ranker, scores, self.fingerprint))

    def get_scores(self, chunk_id: str, ranker: str) -> torch.Tensor | None:
        stored = self.get(chunk_id)
        path = self.scores_path(chunk_id, ranker)
        if stored is None or not path.exists():
            return None
        try:
            return verify_scores(_read_regular(path), self.fingerprint, chunk_id, ranker, int(stored.ranking.numel()))
        except CorruptChunkError as exc:
            log.warning("dropped bad scores file %s: %s", path, exc)
            _discard(path)
            return None

    def drop_page_cache(self) -> int:
        """Ask the kernel to drop its cached pages of every chunk file (posix_fadvise DONTNEED; the
        files are written with fsync, so their pages are clean and can go): the next reads come from
        the device, as a benchmark of this tier needs. Returns the number of files advised."""
        advised = 0
        for path in self.root.glob("*.safetensors"):
            try:
                fd = os.open(path, _OPEN_FLAGS)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                advised += 1
            finally:
                os.close(fd)
        return advised

    def remove(self, chunk_id: str) -> None:
        self._verified.pop(chunk_id, None)  # a request still reading it keeps its descriptor until done
        with self._lock:
            self._sizes.pop(chunk_id, None)
        self.path(chunk_id).unlink(missing_ok=True)
        for sidecar in self.root.glob(f"{chunk_id}.*{SCORES_SUFFIX}"):
            sidecar.unlink(missing_ok=True)


def _read_regular(path: Path) -> bytes:
    """A small file's bytes (no symlink, regular files only), or CorruptChunkError."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise CorruptChunkError(f"cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_HEADER + 2**26:
            raise CorruptChunkError("not a regular file of plausible size")
        blob = bytearray(st.st_size)
        if os.preadv(fd, [blob], 0) != st.st_size:
            raise CorruptChunkError("short read")
        return bytes(blob)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Delete a bad entry; what cannot be deleted (a planted directory) is left and refused again."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove bad chunk entry %s: %s", path, exc.strerror)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
