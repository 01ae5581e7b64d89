"""EngineConfig and ServerConfig: the one validated source of every engine and server default;
EngineConfig loads from a JSON or TOML file.

This module sits at the bottom of the package (it imports nothing from cachetune), so every layer can
read its defaults from here: method settings take `ratio` and `ranking` from the engine's config, the
CLI derives its engine flags from the fields and their comments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 2**30
MEMORY_TIER_BYTES = 4 * GiB  # a memory tier's budget when none is given
DISK_TIER_BYTES = 32 * GiB   # a disk tier's budget when none is given
TIER_ORDER = ("gpu", "cpu", "disk", "redis")  # tier kinds, fastest first
# How cachetune shares a request's recompute budget among chunks (methods.allocation), and the
# online signals that may pick tokens within it (methods.signals).
ALLOCATIONS = ("proportional", "spread", "focus")
SIGNALS = ("none", "question")
QUALITY_FLOOR = 0.15  # the paper's r: the recompute share that keeps quality, and calibration's r_min
# "auto"'s quality floor by chunk length: "TOKENS:RATIO,..." (a request whose chunks average at most
# TOKENS tokens runs at RATIO or more; longer chunks at min_ratio). `cachetune eval --chunk-tokens`
# learns one from a measurement: the least ratio that keeps the default's F1 at QUALITY_TARGET of full
# recompute's at each length. On Qwen2.5-1.5B held-out HotpotQA cut into 512-token chunks that is 0.35
# (0.97 of full recompute's F1; 0.85 at 0.15 and 0.25); at 128 and 256 tokens no ratio up to 0.35
# reached it, so 0.35 stands for them too (docs/results.md, quality by chunk length).
LENGTH_FLOORS = "512:0.35"
QUALITY_TARGET = 0.95  # the share of full recompute's answer quality a quality floor keeps
# Reference media a tier can be paced to (`disk@hdd`): (bytes per second, seconds per read).
MEDIA = {
    "hdd": (150e6, 5e-3),  # a 7200 rpm disk: 150 MB/s, 5 ms a seek
    "ssd": (500e6, 1e-4),  # a SATA SSD: 500 MB/s, 0.1 ms
    "nvme": (3e9, 0.0),    # an NVMe SSD: 3 GB/s
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)/s\s*(?:\+\s*(\d+(?:\.\d+)?)\s*ms)?\s*$",
                   re.IGNORECASE)


def parse_medium(text: str) -> tuple[float, float]:
    """'hdd', 'ssd', 'nvme' (MEDIA), '60MB/s' or '60MB/s+5ms' -> (bytes per second, seconds per read)."""
    if text in MEDIA:
        return MEDIA[text]
    match = _RATE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"not a medium: {text!r} (one of {', '.join(MEDIA)}, or e.g. 60MB/s, 60MB/s+5ms)")
    latency = float(match.group(3)) / 1000 if match.group(3) else 0.0
    return float(match.group(1)) * _UNITS[match.group(2).lower()], latency


def byte_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain number of bytes -> bytes (ValueError otherwise)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_length_floors(text: str) -> tuple[tuple[int, float], ...]:
    """'128:0.25,256:0.15' -> ((128, 0.25), (256, 0.15)): (mean chunk tokens at most, least ratio),
    shortest first; '' -> () (ValueError naming the bad part otherwise)."""
    floors = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        tokens, sep, ratio = part.partition(":")
        try:
            floor = (int(tokens), float(ratio))
        except ValueError:
            floor = None
        if not sep or floor is None or floor[0] < 1 or not 0 <= floor[1] <= 1:
            raise ValueError(f"length floor {part!r}: need TOKENS:RATIO with TOKENS >= 1 and RATIO in [0, 1]")
        floors.append(floor)
    if len({t for t, _ in floors}) != len(floors):
        raise ValueError(f"length floors name a length twice: {text!r}")
    return tuple(sorted(floors))


def length_floor(floors: tuple[tuple[int, float], ...], lengths: list[int]) -> float | None:
    """The floor for a request whose chunks have `lengths` tokens: that of the shortest entry their mean
    fits under; None past the last entry or without chunks."""
    if not lengths:
        return None
    mean = sum(lengths) / len(lengths)
    return next((ratio for tokens, ratio in floors if mean <= tokens), None)


@dataclass(frozen=True)
class TierSpec:
    """One tier of the chunk store: `kind` (TIER_ORDER), a byte budget (None for redis: the server's
    maxmemory) and, for disk, its folder (None: <cache dir>/chunks), for redis its URL; `throttle`
    paces its reads to a slower medium (parse_medium), for benchmarks and calibration."""

    kind: str
    max_bytes: int | None
    path: str | None = None
    throttle: str | None = None

    def label(self, default_dir: str | Path) -> str:
        """What names this tier in a calibration: the kind, a disk's resolved folder, a Redis URL
        without its credentials, and `@medium` when throttled (no size: a budget changes no speed)."""
        if self.kind == "disk":
            name = f"disk:{Path(self.path or default_dir).expanduser().resolve()}"
        elif self.kind == "redis":
            name = re.sub(r"//[^@/]*@", "//", self.path or "")
        else:
            name = self.kind
        return f"{name}@{self.throttle}" if self.throttle else name


def parse_tiers(text: str) -> list[TierSpec]:
    """'gpu:2GiB,cpu:4GiB,disk:/path:100GiB,redis://host:6379' -> tiers fastest first. `cpu`/`gpu`
    alone take MEMORY_TIER_BYTES, a disk without a size DISK_TIER_BYTES; `disk` alone is the cache
    dir; a redis tier is its URL (redis:// or rediss://), its budget the server's own. A memory or disk
    tier ending in `@MEDIUM` (`disk@hdd`, `disk:/path@60MB/s+5ms`) is read at that medium's pace."""
    tiers = []
    for item in (part.strip() for part in text.split(",")):
        if not item.startswith(("redis://", "rediss://")) and "@" in item:
            item, _, throttle = item.rpartition("@")
            parse_medium(throttle)  # raises with the medium named
            tiers.append(replace(parse_tiers(item)[0], throttle=throttle))
            continue
        if item.startswith(("redis://", "rediss://")):
            if not item.split("://", 1)[1]:
                raise ValueError(f"tier {item!r}: a redis tier needs a host, e.g. redis://127.0.0.1:6379")
            tiers.append(TierSpec("redis", None, item))
            continue
        kind, _, rest = item.partition(":")
        if kind == "redis":
            raise ValueError(f"tier {item!r}: a redis tier is a URL, e.g. redis://127.0.0.1:6379")
        if kind not in TIER_ORDER:
            raise ValueError(f"tier {item!r}: kind must be one of {', '.join(TIER_ORDER)}")
        if kind in ("gpu", "cpu"):
            tiers.append(TierSpec(kind, byte_size(rest) if rest else MEMORY_TIER_BYTES))
            continue
        head, _, tail = rest.rpartition(":")  # a trailing ":SIZE" is the budget; the rest is the folder
        path, size = (head, tail) if head or rest.startswith(":") else (rest, "")
        if size and not _SIZE.match(size):
            path, size = rest, ""
        tiers.append(TierSpec(kind, byte_size(size) if size else DISK_TIER_BYTES, path or None))
    ranks = [TIER_ORDER.index(t.kind) for t in tiers]
    if ranks != sorted(ranks):
        raise ValueError(f"tiers {text!r} must go fastest first ({' > '.join(TIER_ORDER)})")
    if len([t for t in tiers if t.kind in ("gpu", "cpu")]) != len({t.kind for t in tiers if t.kind in ("gpu", "cpu")}):
        raise ValueError(f"tiers {text!r}: at most one gpu and one cpu tier")
    return tiers


@dataclass(frozen=True)
class EngineConfig:
    # -- model and machine
    model: str | None = None        # preset name, HF directory or .gguf path; None = smollm2-135m
    dtype: str = "float32"          # exactness tests use float32; bfloat16 is ~3x faster on AMX CPUs
    device: str = "auto"            # "auto" = the first CUDA GPU when there is one, else CPU; or e.g. "cuda:1"
    threads: int | None = None      # torch intra-op threads; None leaves torch's default
    self_check: bool = True         # verify selective prefill against the plain forward at start-up
    # -- requests
    method: str = "cachetune"       # method of a request that names none (see `cachetune.methods`)
    ratio: float = QUALITY_FLOOR    # share of chunk tokens recomputed by methods with a budget (requests: or "auto")
    min_ratio: float = QUALITY_FLOOR  # r_min: calibration's quality floor; "auto" on a tier never calibrated
    length_floors: str = LENGTH_FLOORS  # "auto"'s floor by mean chunk length: TOKENS:RATIO,... (longer: min_ratio)
    calibration: str | None = None  # the calibration file "auto" reads (None: <cache dir>/calibration.json)
    ranking: str = "first"          # offline ranker stored with each chunk, read by cachetune (chunks.rankers)
    # The default: every chunk's first tokens, then the rest shared among chunks by where the question
    # attends in the first layers, up to 4 of its picks per chunk, and the question read over every
    # layer where that pass is cheap beside the prefill; it had the lowest KL at equal TTFT of the
    # selections measured (docs/methods.md). "proportional" / "none" is `first` alone.
    allocation: str = "focus"       # how cachetune shares a request's budget among chunks (methods.allocation)
    signal: str = "question"        # cachetune's online signal within the allocation (SIGNALS)
    deep_within: float = 0.08       # focus + question: deep focus where its predicted price over first's is at most this (0: never)
    alpha: float = 0.5              # share of low frequencies kept by the `lf` ranking
    max_new_tokens: int = 64        # decode budget of a request that sets none
    c2kv_extractor: str = "bundled"  # C2KV extractor: "bundled" (shipped for the model), "paper", "step0" or a file
    kvlink_links: str = "bundled"   # KVLink link tokens: "bundled", "step0" or a file
    block_attention_weights: str = "bundled"  # Block-Attention LoRA fine-tune: "bundled", "step0" or a file
    # -- scheduling and memory
    kv_budget_bytes: int = 4 * GiB  # KV of running requests (prompt + max_new_tokens rows each); others wait
    max_running: int = 16           # requests decoded together in one step
    prefill_tokens_per_step: int = 16384  # prompt tokens admitted per step (at least one request)
    # -- chunk cache
    tiers: str = "cpu:4GiB"         # chunk store, fastest first: gpu:SIZE, cpu:SIZE, disk[:PATH][:SIZE], redis://HOST:PORT
    prefetch: bool = True           # load layer l+1's reused KV while layer l computes
    tracked_chunks: int = 4096      # chunks whose tokens and extra rankings the engine remembers (LRU)
    fallback_bytes: int = GiB       # in-process copies of chunks no tier could take (a shared tier down)
    prefix_blocks: int = 4096       # KV blocks of 16 tokens the prefix cache keeps (LRU)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        parse_tiers(self.tiers)  # raises with the bad part named
        parse_length_floors(self.length_floors)
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if self.allocation == "focus" and self.signal == "none":
            raise ValueError("the focus allocation shares the budget by an online signal: set signal to one of "
                             + ", ".join(s for s in SIGNALS if s != "none"))
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        for name in ("ratio", "min_ratio", "deep_within"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("threads", "max_new_tokens", "kv_budget_bytes", "max_running", "prefill_tokens_per_step",
                     "tracked_chunks", "prefix_blocks", "fallback_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        names = ("method", "ranking", "allocation", "signal", "c2kv_extractor", "kvlink_links", "block_attention_weights")
        if not all(getattr(self, name) for name in names):
            raise ValueError(f"{', '.join(names)} must be non-empty names")
        if self.device != "auto":
            try:
                device = torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}") from exc
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be a CPU or a CUDA GPU, got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        """The device to run on; a CUDA device on a machine (or torch build) without one is an error."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} asked for, but this torch build sees no CUDA GPU")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA GPU(s) present")
        return device

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "EngineConfig":
        """Read a .json or .toml file (keys = field names); `overrides` that are not None win."""
        path = Path(path)
        text = path.read_text()
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a table of settings, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown config keys {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def help(cls, name: str) -> str:
        """The comment beside a field in this file (the CLI's help text for its flag)."""
        return _FIELD_HELP.get(name, "")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of `cachetune serve` (the engine's own are its EngineConfig)."""

    host: str = "127.0.0.1"         # address to listen on; the default, loopback, admits only this machine
    port: int = 8000                # TCP port
    api_key: str | None = None      # when set, every /v1 call must send "Authorization: Bearer <key>"
    served_model_name: str | None = None  # the model id /v1/models lists; None: the engine's model name
    max_queue: int = 64             # requests waiting for the engine; past it new ones get 429 + Retry-After
    max_body_bytes: int = 8 * 2**20  # a larger request body gets 413
    max_prompt_tokens: int | None = None  # longest prompt served (413 past it); None: the model's context window
    max_tokens: int = 2048          # the most new tokens one request may ask for
    max_documents: int = 64         # documents in one request or one registration
    retry_after_s: int = 1          # Retry-After (seconds) sent with a 429 or 503
    auto_ratio: bool = True         # a request without a ratio gets "auto" when a tier of the engine is calibrated
    find_documents: bool = True     # a completion prompt without `documents` reuses the registered documents in it

    def __post_init__(self) -> None:
        _check_types(self)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        for name in ("max_queue", "max_body_bytes", "max_prompt_tokens", "max_tokens", "max_documents",
                     "retry_after_s"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string or None")

    @classmethod
    def help(cls, name: str) -> str:
        return _FIELD_HELP.get(name, "")


def _allowed(annotation) -> tuple[type, ...]:
    """The runtime types an annotation like `int | None` allows (bool is never an int here)."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(type(None) if a is None else a for a in args)


def _check_types(config) -> None:
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, allowed = getattr(config, f.name), _allowed(hints[f.name])
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(config, f.name, float(value))  # 1 in a TOML file means 1.0
            value = float(value)
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            names = " or ".join("None" if a is type(None) else a.__name__ for a in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r} ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be finite, got {value}")


def _field_comments() -> dict[str, str]:
    """Field name -> its trailing comment, read from this file's source (one place for the docs)."""
    import inspect

    out = {}
    try:
        source = inspect.getsource(EngineConfig) + inspect.getsource(ServerConfig)
    except OSError:  # installed without sources: flags just lack help text
        return out
    for line in source.splitlines():
        name, sep, rest = line.strip().partition(":")
        if sep and "#" in rest and name.isidentifier():
            out[name] = rest.split("#", 1)[1].strip()
    return out


_FIELD_HELP = _field_comments()
