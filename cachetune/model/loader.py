"""Load a causal LM by preset name, local HF directory or GGUF file.

GGUF loading dequantizes every tensor (about 60 s for the 1.5B model), so the first load
of a GGUF writes the dequantized weights once as safetensors under
``<cache_dir>/models/<stem>-<key16>/``; later loads read that directory in seconds.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import logging
import os
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from cachetune.errors import ModelLoadError

from .presets import DEFAULT_PRESET, PRESETS, default_cache_dir, resolve_preset

__all__ = ["LoadedModel", "default_cache_dir", "load_model", "model_fingerprint", "cache_key"]

log = logging.getLogger(__name__)

# Bump when the cache layout or conversion changes, so old caches are not reused.
CACHE_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
META_FILE = "cachetune_meta.json"  # written last: its presence marks a complete cache dir
ATTN_IMPLEMENTATION = "sdpa"

# What transformers, safetensors and the GGUF readers raise for a file that is missing, truncated or
# not what it claims to be (found by loading such files, see tests/test_loader.py). Anything else is
# left alone: it is a bug, not a broken file.
_BROKEN_FILE_ERRORS = (OSError, ValueError, struct.error, safetensors.SafetensorError)


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel  # eval mode, requested dtype
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str  # preset name or path given
    source: Path  # the directory the weights were finally loaded from


def load_model(
    spec: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load ``spec``: a preset name (None = smollm2-135m), an HF model directory or a .gguf file."""
    name, directory, gguf = _resolve(spec)
    if directory is not None:
        model, tokenizer = _load_hf_dir(directory, dtype)  # a plain HF directory is used in place
        return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=directory)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    gguf = gguf or resolve_preset(name, cache_dir)
    source = _cached_gguf_dir(gguf, dtype, cache_dir)
    try:
        model, tokenizer = _load_hf_dir(source, dtype)
    except Exception as exc:  # a cache broken in a way the cheap check missed
        log.warning("loading cache %s failed (%s); rebuilding it", source, exc)
        source = _cached_gguf_dir(gguf, dtype, cache_dir, rebuild=True)
        model, tokenizer = _load_hf_dir(source, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=source)


def model_directory(spec: str | os.PathLike[str] | None = None, dtype: torch.dtype = torch.float32,
                    cache_dir: Path | None = None) -> Path:
    """The plain HF directory (config.json, safetensors, tokenizer) that `load_model(spec, dtype)` loads
    from: a preset's or a .gguf file's converted weights (built on first use), or the directory itself.
    Other runtimes (vLLM) load the same weights from it."""
    name, directory, gguf = _resolve(spec)
    if directory is not None:
        return directory
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _cached_gguf_dir(gguf or resolve_preset(name, cache_dir), dtype, cache_dir)


def _resolve(spec: str | os.PathLike[str] | None) -> tuple[str, Path | None, Path | None]:
    """(name, an HF directory used in place or None, a .gguf file or None); a preset gives neither."""
    name = str(spec) if spec is not None else DEFAULT_PRESET
    path = Path(name).expanduser()
    if name in PRESETS:
        return name, None, None
    if path.is_dir() and (path / "config.json").is_file():
        return name, path, None
    if path.is_file() and path.suffix == ".gguf":
        return name, None, path
    raise ModelLoadError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), "
                         "nor a directory with config.json, nor a .gguf file")


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Raises ModelLoadError naming the file for a broken weights file, config or tokenizer."""
    _check_safetensors(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    except _BROKEN_FILE_ERRORS as exc:
        raise ModelLoadError(f"cannot load the model in {path}: {_describe(exc)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except _BROKEN_FILE_ERRORS as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {_describe(exc)}") from exc
    return model.eval(), tokenizer


def _check_safetensors(path: Path) -> None:
    """Read every weights file's header: a file cut short or not safetensors at all is named here
    (transformers' own error does not say which file)."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safetensors.safe_open(file, framework="pt"):
                pass
        except (OSError, safetensors.SafetensorError) as exc:
            raise ModelLoadError(
                f"{file}: not a valid safetensors file, corrupt or truncated ({_describe(exc)})"
            ) from exc


def _describe(exc: BaseException) -> str:
    """One line about what went wrong: the innermost cause (transformers re-raises a GGUF parse error
    as "not a valid JSON file"), with its message on one line."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    kind = type(exc).__name__
    if kind == "error":  # struct.error
        kind = f"{type(exc).__module__}.{kind}"
    text = " ".join(str(exc).split())
    return f"{kind}: {text}" if text else kind


# ---------------------------------------------------------------- GGUF -> safetensors cache


def cache_key(gguf: Path, dtype: torch.dtype) -> str:
    """Content key of a converted GGUF, from cheap file facts (no hashing of the GGUF itself).

    The name + size + mtime identify the file; dtype, transformers version and the cache
    format identify the conversion.
    """
    st = gguf.stat()
    facts = {
        "file": gguf.name,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": str(dtype),
        "transformers": transformers.__version__,
        "format": CACHE_FORMAT,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _cached_gguf_dir(gguf: Path, dtype: torch.dtype, cache_dir: Path, rebuild: bool = False) -> Path:
    """Directory holding ``gguf`` converted to safetensors in ``dtype``; built if absent or broken."""
    gguf = gguf.resolve()
    key = cache_key(gguf, dtype)
    target = cache_dir / "models" / f"{gguf.stem}-{key[:16]}"
    if not rebuild and _is_complete(target, key):
        return target
    if target.exists():
        log.warning("cache %s is incomplete or corrupt; rebuilding it", target)
    _build_cache(gguf, dtype, target, key, replace_complete=rebuild)
    return target


def _is_complete(target: Path, key: str) -> bool:
    """Cheap integrity check: marker matches, every file has its recorded size, header parses."""
    try:
        meta = json.loads((target / META_FILE).read_text())
        if meta.get("key") != key:
            return False
        if any((target / f).stat().st_size != size for f, size in meta["files"].items()):
            return False
        # safe_open validates the header against the file length (catches truncation).
        with safetensors.safe_open(target / WEIGHTS_FILE, framework="pt") as f:
            return set(f.keys()) == set(meta["tensors"])
    except Exception:  # any unreadable piece means: rebuild
        return False


def _load_gguf(gguf: Path, dtype: torch.dtype) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Dequantize a GGUF into a torch model (slow; done once per cache key).

    Raises ModelLoadError for a file that is truncated or garbage behind a valid header."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except _BROKEN_FILE_ERRORS as exc:
        raise ModelLoadError(f"{gguf}: not a readable GGUF model, corrupt or truncated ({_describe(exc)})") from exc
    return model, tokenizer


def _unique_state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """State dict with each shared tensor stored once (safetensors refuses aliases).

    For tied embeddings the tied name (e.g. lm_head.weight) is dropped and the source
    kept; from_pretrained re-ties it from config.tie_word_embeddings.
    """
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    groups: dict[tuple, list[str]] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        groups.setdefault(ident, []).append(name)
    out = {}
    for names in groups.values():
        keep = next((n for n in names if n not in tied), names[0])
        out[keep] = state[keep].detach().contiguous()
    return out


def _build_cache(gguf: Path, dtype: torch.dtype, target: Path, key: str, replace_complete: bool) -> None:
    """Convert ``gguf`` into ``target`` via a temp dir renamed into place.

    Unless ``replace_complete``, a ``target`` that another process completed meanwhile is
    kept (same content) instead of being swapped under its readers.
    """
    start = time.perf_counter()
    log.info("converting %s to safetensors (%s) in %s", gguf.name, dtype, target)
    model, tokenizer = _load_gguf(gguf, dtype)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        tensors = _unique_state_dict(model)
        safetensors.torch.save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        # The weights are now plain tensors: drop the GGUF quantization marker so the
        # directory loads as an ordinary model (save_pretrained refuses GGUF models).
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = dtype
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {
            "key": key,
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
            "gguf": str(gguf),
            "dtype": str(dtype),
            "transformers": transformers.__version__,
            "tensors": sorted(tensors),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        del model, tensors
        gc.collect()
        if replace_complete or not _is_complete(target, key):
            _replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached %s in %.1f s", target.name, time.perf_counter() - start)


def _replace_dir(tmp: Path, target: Path) -> None:
    """Atomically move ``tmp`` to ``target``, first moving any old (broken) target aside."""
    if target.exists():
        trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(target, trash)
        except FileNotFoundError:
            pass  # another process removed it meanwhile
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        # A concurrent loader finished the same directory first; it holds identical content.
        if not target.is_dir():
            raise


# ---------------------------------------------------------------- fingerprint

# Config entries that do not change what the weights compute (paths, versions, runtime switches).
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "name_or_path",
    "architectures",  # set by save_pretrained, absent on GGUF-loaded configs
}
_SAMPLE_EDGE = 64  # first/last elements sampled per parameter
_SAMPLE_SPREAD = 256  # evenly spaced elements sampled per parameter


def _config_for_fingerprint(config: transformers.PretrainedConfig) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}


def _sample(param: torch.Tensor) -> torch.Tensor:
    """A deterministic handful of values: edges plus an even spread (catches a mid-tensor edit)."""
    flat = param.detach().reshape(-1)
    n = flat.numel()
    if n <= 2 * _SAMPLE_EDGE + _SAMPLE_SPREAD:
        return flat.to(torch.float32)
    spread = torch.arange(_SAMPLE_SPREAD, dtype=torch.int64) * (n - 1) // (_SAMPLE_SPREAD - 1)
    return torch.cat([flat[:_SAMPLE_EDGE], flat[spread], flat[-_SAMPLE_EDGE:]]).to(torch.float32)


def _checksum(param: torch.Tensor) -> int:
    """Exact integer sum of the tensor's bytes read as int32: any single changed value shows.

    Integer addition is order-independent, so unlike a float sum the result cannot depend on
    threading; it reads the weights once (numpy, ~0.1 s/GB) instead of sha256-hashing them.
    """
    raw = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if raw.size % 4:
        return int(raw.sum(dtype=np.int64))
    return int(raw.view(np.int32).sum(dtype=np.int64))  # no overflow below 16 GB per tensor


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the config and, per parameter (name order), its name, shape, dtype, a value
    sample and an integer checksum of its bytes.

    Equal weights + config give equal fingerprints regardless of where they were loaded
    from (path, versions and runtime switches are left out of the config part).
    """
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(json.dumps(_config_for_fingerprint(config), sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(f"|{name}|{tuple(param.shape)}|{param.dtype}|".encode())
        h.update(_sample(param).cpu().numpy().tobytes())
        h.update(str(_checksum(param)).encode())
    return h.hexdigest()


def weights_identity(model: torch.nn.Module) -> str:
    """Like model_fingerprint, but equal for a model in float32 and its bfloat16 cast: the config,
    parameter names and shapes and sampled values rounded to bfloat16. Trained add-ons (a C2KV
    extractor) name their base model by it, so one extractor serves the model in either dtype."""
    h = hashlib.sha256(b"weights-identity/1")
    config = getattr(model, "config", None)
    if config is not None:
        data = _config_for_fingerprint(config)
        data = {k: v for k, v in data.items() if k not in ("dtype", "torch_dtype")} if isinstance(data, dict) else data
        h.update(json.dumps(data, sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(f"|{name}|{tuple(param.shape)}|".encode())
        h.update(_sample(param).to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()
