"""Validated configuration for the engine, loadable from a JSON or TOML file and overridable."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from cachetune.chunks.rankers import DEFAULT_RANKER, get_ranker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None        # preset name, HF directory or .gguf path; None = smollm2-135m
    dtype: str = "float32"          # exactness tests use float32; bfloat16 is ~3x faster on AMX CPUs
    device: str = "auto"            # "auto" = the first CUDA GPU when there is one, else CPU; or e.g. "cuda:1"
    threads: int | None = None      # torch intra-op threads; None leaves torch's default
    alpha: float = 0.5              # share of low frequencies kept by the `lf` ranking
    ranking: str = DEFAULT_RANKER   # offline ranker stored with each chunk (cachetune.chunks.rankers)
    store: str = "memory"           # "memory" (CPU RAM) or "disk"
    store_dir: str | None = None    # disk tier root; default <cache dir>/chunks
    prefetch: bool = True           # load layer l+1's reused KV while layer l computes
    self_check: bool = True         # verify selective prefill against the plain forward at start-up

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.store not in ("memory", "disk"):
            raise ValueError(f"store must be 'memory' or 'disk', got {self.store!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        get_ranker(self.ranking, self.alpha)  # raises a clear error for an unknown ranker
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}") from exc

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "EngineConfig":
        """Read a .json or .toml file (keys = field names); `overrides` that are not None win."""
        path = Path(path)
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown config keys {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)
