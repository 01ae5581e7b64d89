"""Shared builders for the engine tests: tiny random-weight models (no download) and prompt layouts.

Models use initializer_range=0.2 so attention is far from uniform: with HF's default 0.02 a key at a
wrong position barely moves the logits and an exactness test could not fail. Everything is float32 and
seeded; references are always Hugging Face's own forward, never cachetune code.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from cachetune.chunks.encode import encode_chunk
from cachetune.engine.layout import PromptLayout, Segment
from cachetune.model.adapter import ModelAdapter
from cachetune.store.memory import MemoryStore

VOCAB = 300
FINGERPRINT = "fp"

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def make_config(family: str):
    """Tiny config per family. Sliding windows (64) are much shorter than the test prompts (>300)."""
    if family == "llama":
        return LlamaConfig(**_COMMON)
    if family == "llama3_rope":
        return LlamaConfig(**_COMMON, rope_parameters=dict(LLAMA3_ROPE))
    if family == "mistral":
        return MistralConfig(**_COMMON, sliding_window=64)
    if family == "qwen2":
        return Qwen2Config(**_COMMON)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16)
    if family in ("gemma3_text", "gemma3_text_softcap"):
        extra = {"final_logit_softcapping": 5.0} if family.endswith("softcap") else {}
        return Gemma3TextConfig(
            **_COMMON,
            head_dim=16,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **extra,
        )
    raise KeyError(family)


@functools.lru_cache(maxsize=None)
def _build(family: str, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family), attn_implementation="sdpa").eval()
    model.float()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_model(family: str, seed: int = 0):
    """Cached across the session: tests must not modify the model (monkeypatch the adapter instead)."""
    return _build(family, seed)


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: tiny_model(family, seed=0) -> eval float32 HF causal LM."""
    return build_model


@pytest.fixture(scope="session")
def tiny_adapter():
    """Factory: tiny_adapter(family) -> (model, fresh ModelAdapter). A fresh adapter is safe to monkeypatch."""

    def make(family: str, seed: int = 0):
        model = build_model(family, seed)
        return model, ModelAdapter(model)

    return make


def rand_ids(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Random token ids in [3, vocab) (special ids 0..2 avoided)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def build_layout(adapter: ModelAdapter, parts, store: MemoryStore | None = None):
    """parts: list of (token_ids, cached: bool) in prompt order -> (PromptLayout, store).

    Cached parts are encoded alone with encode_chunk, put in a MemoryStore and referenced through
    store.get(id), exactly as the engine does.
    """
    store = store if store is not None else MemoryStore()
    segments = []
    for ids, cached in parts:
        if cached:
            enc = encode_chunk(adapter, ids, FINGERPRINT)
            store.put(enc)
            segments.append(Segment(ids, store.get(enc.chunk_id)))
        else:
            segments.append(Segment(ids))
    return PromptLayout(segments), store


@pytest.fixture(scope="session")
def layout_builder():
    return build_layout


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max |ref - got| / max |ref| (NaN-safe: NaN gives inf)."""
    ref, got = ref.detach().float(), got.detach().float()
    err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-12))
    return err if err == err else float("inf")


def assert_close(ref: torch.Tensor, got: torch.Tensor, tol: float = 1e-4, what: str = "") -> None:
    assert ref.shape == got.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(ref, got)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


@torch.no_grad()
def hf_forward(model, ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache=None):
    """HF forward of ids [T]; returns (logits [T, vocab] float32, cache).

    A plain DynamicCache() (no config) keeps every row of every layer: with the config, HF would create
    sliding-window layers that keep only the last window-1 rows.
    """
    cache = cache if cache is not None else DynamicCache()
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids[None]
    out = model(input_ids=ids[None], cache=cache, use_cache=True, **kwargs)
    return out.logits[0].float(), cache


def hf_layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated keys and values [T, Hkv, D] of one layer of an HF cache ([1, Hkv, T, D])."""
    entry = cache.layers[layer]
    return entry.keys[0].transpose(0, 1), entry.values[0].transpose(0, 1)
