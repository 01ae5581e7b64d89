"""Trained auxiliary tokens on a frozen model: learned embeddings with their own per-layer Q/K/V.

C2KV's C2Tokens and KVLink's link tokens are both tokens that do not exist in the vocabulary. They
enter layer 0 as learned embeddings and, at every layer, are projected by their own Q/K/V (shaped like
the base model's, initialised as copies of them, trained in full or by LoRA through `peft`), while the
model's norms, output projection and MLP stay frozen and shared. Ordinary tokens never use these
projections, so the base model's behaviour on real text is untouched.

Files are safetensors (nothing is unpickled) holding only the trained tensors, with the config, the
base model's weights identity (model.loader.weights_identity) and the file kind in the metadata.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cachetune.model.adapter import ModelAdapter


class TokensFileError(ValueError):
    """A trained-tokens file that is unreadable, or made for another model, kind or layout."""


class TrainedFile:
    """What every trained add-on of a frozen base model shares (a mixin for torch modules): the trained
    tensors, a content-address fingerprint, and a safetensors file of just those tensors.

    Subclasses set FORMAT (the file kind), CONFIG (a frozen dataclass), VARIANT (the chunk-id variant
    prefix of what they produce, e.g. "c2kv") and STEP0 (names of untrained instances -> config), and
    are built as `cls(adapter, config, base_identity, eos_id)`; they hold `config` and `base_identity`."""

    FORMAT: str
    CONFIG: type
    VARIANT: str
    STEP0: dict = {}

    def mark_trained(self) -> None:
        """Record the tensors that train (those requiring grad now): what is saved and fingerprinted
        stays the same after serving turns grad off."""
        self._trained = [name for name, p in self.named_parameters() if p.requires_grad]

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        params = dict(self.named_parameters())
        return {name: params[name] for name in self._trained}

    def fingerprint(self) -> str:
        """Content address: kind, config, base model and every trained tensor (32 hex digits); the
        frozen rest is the base model's, which the identity names."""
        h = hashlib.sha256(self.FORMAT.encode())
        h.update(json.dumps(asdict(self.config), sort_keys=True).encode())
        h.update(self.base_identity.encode())
        for name, tensor in sorted(self.trainable().items()):
            h.update(name.encode())
            h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:32]

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Write the trained tensors (LoRA: only the adapters and embeddings) atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {n: p.detach().cpu().contiguous() for n, p in self.trainable().items()}
        meta = {"format": self.FORMAT, "config": json.dumps(asdict(self.config)), "base": self.base_identity,
                **{k: json.dumps(v) for k, v in (extra or {}).items()}}
        tmp = path.with_suffix(path.suffix + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path, adapter: ModelAdapter, base_identity: str, eos_id: int):
        """Read a file of this kind for this base model; another model, kind or layout is an error."""
        meta, tensors = read_tokens_file(path, cls.FORMAT)
        if meta["base"] != base_identity:
            raise TokensFileError(f"{path}: trained for another base model")
        try:
            config = cls.CONFIG(**json.loads(meta["config"]))
        except (TypeError, ValueError) as exc:
            raise TokensFileError(f"{path}: bad config in the metadata ({exc})") from None
        trained = cls(adapter, config, base_identity, eos_id)
        expected = trained.trainable()
        if set(tensors) != set(expected) or any(tensors[n].shape != p.shape for n, p in expected.items()):
            raise TokensFileError(f"{path}: tensors do not match the layout of a {cls.FORMAT} file")
        with torch.no_grad():
            for name, param in expected.items():
                param.copy_(tensors[name])
        return trained


class TrainedTokens(TrainedFile, torch.nn.Module):
    """Embedding(s) and per-layer projection copies for one base model (CONFIG may have `lora_rank`
    and `lora_alpha`).

    embedding: [hidden] when `count` is None (one shared token), else [count, hidden]; every row
    starts as the EOS token's embedding (what the model really feeds layer 0, Gemma's scale included)."""

    OWN_PROJECTIONS: bool = True  # False: the tokens use the model's own projections (embeddings only)

    def __init__(self, adapter: ModelAdapter, config, base_identity: str, eos_id: int, count: int | None):
        super().__init__()
        self.config = config
        self.base_identity = base_identity
        start = adapter.backbone.embed_tokens(torch.tensor([eos_id], device=adapter.device))[0]
        start = start.detach().float()
        self.embedding = torch.nn.Parameter(start.clone() if count is None else start.repeat(count, 1))
        self.q, self.k, self.v = (torch.nn.ModuleList() for _ in range(3))
        for layer in adapter.layers if self.OWN_PROJECTIONS else ():
            attn = layer.self_attn
            for mine, base in ((self.q, attn.q_proj), (self.k, attn.k_proj), (self.v, attn.v_proj)):
                lin = copy.deepcopy(base).float()
                lin.requires_grad_(getattr(config, "lora_rank", 0) == 0)
                mine.append(lin)
        if getattr(config, "lora_rank", 0):
            from peft import LoraConfig, inject_adapter_in_model

            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=r"^[qkv]\.\d+$")
            inject_adapter_in_model(lora, self)  # freezes everything but the adapters...
            self.embedding.requires_grad_(True)   # ...and the embedding trains in both variants
        self.to(adapter.device)
        self.mark_trained()

    def projections(self, layer: int):
        """This layer's own (q, k, v) modules, or None when the tokens use the model's."""
        return (self.q[layer], self.k[layer], self.v[layer]) if self.OWN_PROJECTIONS else None


def read_tokens_file(path: str | Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a trained-tokens file of `kind`; a clear error if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # missing, truncated or not safetensors
        raise TokensFileError(f"{path}: not a readable {kind} file ({exc})") from None
    if meta.get("format") != kind or "config" not in meta or "base" not in meta:
        raise TokensFileError(f"{path}: not a {kind} file")
    return meta, tensors


def export_tokens(src: str | Path, dst: str | Path, kind: str, dtype: torch.dtype = torch.bfloat16,
                  extra: dict | None = None) -> Path:
    """Copy a trained-tokens file with its tensors cast to `dtype` (what is shipped: half the bytes of
    float32 training weights); the metadata is kept, `extra` is added to it."""
    meta, tensors = read_tokens_file(src, kind)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    meta = {**meta, **{k: json.dumps(v) for k, v in (extra or {}).items()}}
    save_file({n: t.to(dtype).contiguous() for n, t in tensors.items()}, str(tmp), metadata=meta)
    tmp.replace(dst)
    return dst
