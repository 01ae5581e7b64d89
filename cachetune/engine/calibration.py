"""The calibration file: what was measured on this machine for each (model, device, dtype).

- the recompute ratio chosen for each tier, which a request with ratio="auto" uses (written by
  `cachetune calibrate`);
- deep focus's price scale: its measured price over `first` per predicted one
  (methods.signals.deep_focus_price), which the `deep_within` setting multiplies its predictions by
  (written by `cachetune calibrate-price`).

    {"format": "cachetune-calibration/1",
     "entries": {"<fingerprint>|<device>|<dtype>|<tier>": {"ratio": 0.31, "min_ratio": 0.15, ...},
                 "<fingerprint>|<device>|<dtype>||price": {"scale": 1.06, ...}}}

A key names everything the best ratio depends on: the model's weights (fingerprint), the device
(a GPU's name, or the CPU's model and thread count: a copied file is not valid on another machine),
the dtype, the tier's label (config.TierSpec.label) and what was measured (KINDS). An entry whose
key no longer matches is simply never found. The file is plain JSON (nothing is unpickled); writes
replace it atomically under a lock, so calibrations of several tiers can run at once; a file that
cannot be read or an entry without a valid value (KINDS) is reported and ignored, never used (a
store() moves an unreadable file aside to `<name>.bad` rather than overwrite it).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from cachetune.atomic import write_text_atomic

log = logging.getLogger(__name__)

AUTO = "auto"  # the ratio a request asks for to get the calibrated one
FORMAT = "cachetune-calibration/1"
FILE_NAME = "calibration.json"  # under the cache dir when EngineConfig.calibration is None
RATIO, PRICE = "ratio", "price"  # what an entry holds: a tier's ratio, deep focus's price scale
# kind -> the entry's value field and its valid range [low, high]
KINDS = {RATIO: ("ratio", 0.0, 1.0), PRICE: ("scale", 1e-3, 1e3)}


@lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown cpu"


def device_identity(device: torch.device) -> str:
    """What the ratio's compute side depends on: 'cuda:<GPU name>', or 'cpu:<model>:<threads>t'."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{_cpu_model()}:{torch.get_num_threads()}t"


@dataclass(frozen=True)
class CalibrationKey:
    fingerprint: str  # model_fingerprint of the weights
    device: str       # device_identity
    dtype: str        # EngineConfig.dtype
    tier: str         # the tier's label (where the request's chunks are read from); "" for a price
    kind: str = RATIO  # what the entry holds (KINDS)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown calibration kind {self.kind!r}; known: {', '.join(KINDS)}")

    def text(self) -> str:
        fields = (self.fingerprint, self.device, self.dtype, self.tier)
        return "|".join(fields if self.kind == RATIO else (*fields, self.kind))


def _valid_value(entry, kind: str) -> float | None:
    """The entry's value (KINDS[kind]'s field), or None where it is not a number in its range."""
    field, low, high = KINDS[kind]
    value = entry.get(field) if isinstance(entry, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and low <= value <= high:
        return float(value)
    return None


class CalibrationFile:
    """One calibration file. Reads follow the file: a calibration written by another process is
    seen on the next lookup (the file's inode, size and mtime are checked, no re-read otherwise)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self._seen: tuple[int, int, int] | None = None
        self._entries: dict[str, dict] = {}
        self._unreadable = False  # the file exists but is not a calibration file

    def entries(self) -> dict[str, dict]:
        """Every entry by key text ({} when there is no file or it cannot be read)."""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._entries = None, {}
            return {}
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen != self._seen:
            self._seen, self._entries = seen, self._read()
        return self._entries

    def _read(self) -> dict[str, dict]:
        self._unreadable = True
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            log.warning("calibration file %s cannot be read (%s): ignored", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            log.warning("calibration file %s is not %s: ignored", self.path, FORMAT)
            return {}
        self._unreadable = False
        return data["entries"]

    def lookup(self, key: CalibrationKey) -> dict | None:
        """The entry for `key`, or None (absent, or its value is not a number in its kind's range)."""
        entry = self.entries().get(key.text())
        if entry is None:
            return None
        if _valid_value(entry, key.kind) is None:
            log.warning("calibration %s in %s has no valid %s: ignored", key.text(), self.path, KINDS[key.kind][0])
            return None
        return entry

    def value(self, key: CalibrationKey) -> float | None:
        """The entry's value (a ratio, a price scale: KINDS), or None."""
        entry = self.lookup(key)
        return _valid_value(entry, key.kind) if entry is not None else None

    def ratio(self, key: CalibrationKey) -> float | None:
        return self.value(key)

    def store(self, key: CalibrationKey, entry: dict) -> None:
        """Add or replace the entry for `key` (its value, KINDS[key.kind], must be a number in its
        range); other entries are kept. Read-modify-write under an exclusive lock, then an atomic replace."""
        if _valid_value(entry, key.kind) is None:
            field, low, high = KINDS[key.kind]
            raise ValueError(f"a {key.kind} calibration entry needs a {field} in [{low:g}, {high:g}], "
                             f"got {entry.get(field)!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._seen = None
            entries = dict(self.entries())
            if self._unreadable:  # kept aside for a look, not overwritten
                os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
                log.warning("moved the unreadable calibration file to %s.bad", self.path)
            entries[key.text()] = {**entry, "key": {"fingerprint": key.fingerprint, "device": key.device,
                                                    "dtype": key.dtype, "tier": key.tier,
                                                    "kind": key.kind}}
            write_text_atomic(self.path, json.dumps({"format": FORMAT, "entries": entries}, indent=2, sort_keys=True))
            self._seen = None
