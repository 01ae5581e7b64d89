"""EngineConfig validation and file loading; sampling settings."""

from __future__ import annotations

import pytest
import torch

from cachetune.config import EngineConfig
from cachetune.engine.decode import SamplingConfig, sample


def test_config_loads_from_toml_and_json_with_overrides(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('dtype = "bfloat16"\nalpha = 0.25\nstore = "disk"\n')
    cfg = EngineConfig.from_file(toml, alpha=None, threads=2)
    assert (cfg.dtype, cfg.alpha, cfg.store, cfg.threads) == ("bfloat16", 0.25, "disk", 2)
    assert cfg.torch_dtype is torch.bfloat16
    js = tmp_path / "c.json"
    js.write_text('{"prefetch": false}')
    assert EngineConfig.from_file(js).prefetch is False


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"store": "tape"}, {"alpha": 0.0}, {"threads": 0}, {"ranking": "nope"},
                                 {"device": "gpu0"}])
def test_config_rejects_invalid_values(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_device_auto_takes_a_gpu_only_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().torch_device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
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
    wide = SamplingConfig(temperature=1.0, top_p=1.0)
    a = [sample(logits, wide, torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [sample(logits, wide, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b and set(a) <= {0, 1}


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}])
def test_sampling_config_rejects_invalid_values(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)
