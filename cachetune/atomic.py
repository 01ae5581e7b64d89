"""Atomic file writes: a reader sees the old file or the whole new one, never half of either."""

from __future__ import annotations

import os
import time
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, fsynced, then renamed over it.

    The temporary file is created with mode 0o666 less the umask, as `open` would create `path`
    (tempfile.mkstemp's 0o600 would leave reports and shared calibration files readable by their
    writer only), and removed when anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
