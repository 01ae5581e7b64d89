"""EngineConfig validation and file loading; sampling settings."""

from __future__ import annotations

import pytest
import torch

from cachetune.config import (DISK_TIER_BYTES, GiB, EngineConfig, TierSpec, length_floor, parse_length_floors,
                              parse_tiers)
from cachetune.runtime.decode import SamplingConfig, sample


def test_config_loads_from_toml_and_json_with_overrides(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('dtype = "bfloat16"\nalpha = 0.25\ntiers = "cpu:1GiB,disk:/tmp/x:2GiB"\n')
    cfg = EngineConfig.from_file(toml, alpha=None, threads=2)
    assert (cfg.dtype, cfg.alpha, cfg.tiers, cfg.threads) == ("bfloat16", 0.25, "cpu:1GiB,disk:/tmp/x:2GiB", 2)
    assert cfg.torch_dtype is torch.bfloat16
    js = tmp_path / "c.json"
    js.write_text('{"prefetch": false}')
    assert EngineConfig.from_file(js).prefetch is False


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"tiers": "tape:1GiB"}, {"alpha": 0.0}, {"threads": 0}, {"ratio": 1.5},
                                 {"device": "gpu0"}, {"device": "mps"}, {"threads": "2"}, {"prefetch": "yes"},
                                 {"ratio": float("nan")}, {"kv_budget_bytes": 0}, {"max_running": True},
                                 {"allocation": "sideways"}, {"signal": "psychic"}, {"deep_within": 1.5},
                                 {"deep_within": None}, {"length_floors": "128"}, {"length_floors": "128:1.5"},
                                 {"length_floors": "0:0.2"}, {"length_floors": "128:0.2,128:0.3"},
                                 {"length_floors": "short:0.2"}])
def test_config_rejects_invalid_values(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_length_floors_parse_shortest_first_and_apply_by_the_mean_chunk_length():
    floors = parse_length_floors(" 256:0.2, 128:0.3 ,")
    assert floors == ((128, 0.3), (256, 0.2)) and parse_length_floors("") == ()
    assert [length_floor(floors, lengths) for lengths in ([100, 150], [128], [129], [200, 312], [257], [])] == \
        [0.3, 0.3, 0.2, 0.2, None, None]


def test_config_file_with_wrong_types_names_the_field(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('threads = "two"\n')
    with pytest.raises(ValueError, match="threads must be int or None"):
        EngineConfig.from_file(path)
    path.write_text("ratio = 1\n")  # an integer where a float goes is fine
    assert EngineConfig.from_file(path).ratio == 1.0
    path.write_text("ratio = [")
    with pytest.raises(ValueError, match="not valid toml"):
        EngineConfig.from_file(path)


def test_unknown_ranking_or_method_fails_when_the_engine_starts():
    from conftest import tiny_engine

    with pytest.raises(ValueError, match="unknown ranker"):
        tiny_engine(ranking="nope")
    with pytest.raises(ValueError, match="unknown method"):
        tiny_engine(method="nope")


def test_a_cuda_device_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        EngineConfig(device="cuda").torch_device


def test_device_auto_takes_a_gpu_only_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().torch_device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert EngineConfig().torch_device == torch.device("cuda")
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")
    assert EngineConfig(device="cuda:1").torch_device == torch.device("cuda", 1)


def test_config_file_with_unknown_key_is_rejected(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"dtpye": "float32"}')
    with pytest.raises(ValueError, match="dtpye"):
        EngineConfig.from_file(path)


def test_greedy_sampling_takes_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9])
    assert sample(logits, SamplingConfig(), None) == 1


def test_top_p_keeps_only_the_nucleus_and_seed_reproduces():
    logits = torch.tensor([5.0, 4.9, -10.0, -10.0])
    cfg = SamplingConfig(temperature=1.0, top_p=0.5)
    draws = {sample(logits, cfg, torch.Generator().manual_seed(s)) for s in range(30)}
    assert draws == {0}  # the top token alone already covers half the mass
    wide = SamplingConfig(temperature=1.0, top_p=1.0, seed=7)

    def draws(cfg):
        generator = cfg.generator()  # one generator per request, drawn from again and again
        return [sample(logits, cfg, generator) for _ in range(40)]

    a, b = draws(wide), draws(wide)
    assert a == b  # the same seed reproduces the whole sequence
    assert set(a) == {0, 1}  # and the draws really vary (0.52 / 0.48 mass)
    assert draws(SamplingConfig(temperature=1.0, seed=8)) != a


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}])
def test_sampling_config_rejects_invalid_values(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


@pytest.mark.parametrize("text, tiers", [
    ("cpu:4GiB", [TierSpec("cpu", 4 * GiB)]),
    ("cpu", [TierSpec("cpu", 4 * GiB)]),
    ("gpu:512MiB, cpu:2GiB", [TierSpec("gpu", 512 * 2**20), TierSpec("cpu", 2 * GiB)]),
    ("cpu:1GiB,disk:/data/kv:100GiB", [TierSpec("cpu", GiB), TierSpec("disk", 100 * GiB, "/data/kv")]),
    ("disk:/data/kv", [TierSpec("disk", DISK_TIER_BYTES, "/data/kv")]),
    ("disk", [TierSpec("disk", DISK_TIER_BYTES)]),
    ("disk::1GB", [TierSpec("disk", 10**9)]),
    ("disk:/a:b/c:1GiB,disk:/slow", [TierSpec("disk", GiB, "/a:b/c"), TierSpec("disk", DISK_TIER_BYTES, "/slow")]),
])
def test_tier_lists_parse_fastest_first(text, tiers):
    assert parse_tiers(text) == tiers


@pytest.mark.parametrize("text, message", [
    ("tape:1GiB", "kind must be one of"), ("cpu:lots", "not a size"), ("disk:/x,cpu:1GiB", "fastest first"),
    ("cpu:1GiB,cpu:2GiB", "at most one"), ("", "kind must be one of"),
])
def test_bad_tier_lists_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tiers=text)


def test_focus_allocation_needs_a_signal():
    assert EngineConfig(allocation="focus", signal="question").allocation == "focus"
    with pytest.raises(ValueError, match="focus allocation shares the budget by an online signal"):
        EngineConfig(allocation="focus", signal="none")
