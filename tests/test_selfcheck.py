"""run_self_check: passes on a correct adapter, refuses reuse (ReuseRefusedError) when anything on the
selective path is broken: RoPE, attention scale, stored keys, or NaNs."""

from __future__ import annotations

import pytest
import torch

from cachetune.chunks import encode as encode_mod
from cachetune.engine import selfcheck
from cachetune.engine.selfcheck import ReuseRefusedError, run_self_check
from conftest import VOCAB


@pytest.fixture
def llama(tiny_adapter):
    """A fresh adapter per test (the model itself is shared and never modified)."""
    return tiny_adapter("llama")


def test_passes_and_returns_small_error(llama):
    _, adapter = llama
    err = run_self_check(adapter, "fp", VOCAB)
    assert isinstance(err, float)
    assert 0.0 <= err < 1e-4


def _identity(adapter):
    return lambda x, cos, sin: x


def _inverse_rotation(adapter):
    rotate_half = adapter._rotate_half
    return lambda x, cos, sin: x * cos.unsqueeze(1) - rotate_half(x) * sin.unsqueeze(1)


def _nan(adapter):
    original = adapter.rotate
    return lambda x, cos, sin: original(x, cos, sin) * float("nan")


@pytest.mark.parametrize("broken", [_identity, _inverse_rotation, _nan], ids=["identity", "inverse", "nan"])
def test_broken_rotation_is_refused(llama, monkeypatch, broken):
    _, adapter = llama
    monkeypatch.setattr(adapter, "rotate", broken(adapter))
    with pytest.raises(ReuseRefusedError, match="llama"):
        run_self_check(adapter, "fp", VOCAB)


def test_positions_off_by_one_past_a_point_are_refused(llama, monkeypatch):
    """RoPE tables at position+1 for positions >= 40 (a uniform shift would be harmless: RoPE is relative)."""
    _, adapter = llama
    original = adapter.rope_tables
    monkeypatch.setattr(adapter, "rope_tables", lambda pos, dtype=None: original(pos + (pos >= 40).long(), dtype))
    with pytest.raises(ReuseRefusedError):
        run_self_check(adapter, "fp", VOCAB)


def test_uniform_position_shift_is_harmless(llama, monkeypatch):
    """Control for the test above: rotating everything at position+1 changes nothing (relative RoPE)."""
    _, adapter = llama
    original = adapter.rope_tables
    monkeypatch.setattr(adapter, "rope_tables", lambda pos, dtype=None: original(pos + 1, dtype))
    assert run_self_check(adapter, "fp", VOCAB) < 1e-4


def test_wrong_attention_scale_is_refused(llama, monkeypatch):
    _, adapter = llama
    info = adapter.layer_info
    monkeypatch.setattr(adapter, "layer_info", [type(i)(i.scale * 1.5, i.sliding_window, i.rope_kind) for i in info])
    with pytest.raises(ReuseRefusedError):
        run_self_check(adapter, "fp", VOCAB)


def test_keys_stored_after_rope_are_refused(llama, monkeypatch):
    """Only the r=0 case reads stored keys: chunks stored already rotated must be caught there."""
    _, adapter = llama
    real_encode = encode_mod.encode_chunk

    def encode_rotated(adapter, token_ids, fingerprint, *args, **kwargs):
        enc = real_encode(adapter, token_ids, fingerprint, *args, **kwargs)
        n = enc.num_tokens
        cos, sin = adapter.rope_tables(torch.arange(n))[None]  # Llama has one RoPE kind, keyed None
        enc.keys = torch.stack([adapter.rotate(k, cos, sin) for k in enc.keys])
        return enc

    monkeypatch.setattr(selfcheck, "encode_chunk", encode_rotated)
    with pytest.raises(ReuseRefusedError, match="self-check 2"):
        run_self_check(adapter, "fp", VOCAB)


def test_error_message_points_to_full_recompute(llama, monkeypatch):
    _, adapter = llama
    monkeypatch.setattr(adapter, "rotate", _identity(adapter))
    with pytest.raises(ReuseRefusedError, match="full_recompute"):
        run_self_check(adapter, "fp", VOCAB)


def test_self_check_leaves_adapter_usable(llama):
    """Running the check twice gives the same answer (no state leaks between runs)."""
    _, adapter = llama
    assert run_self_check(adapter, "fp", VOCAB) == run_self_check(adapter, "fp", VOCAB)
