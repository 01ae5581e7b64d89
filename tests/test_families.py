"""Every supported family against Hugging Face's own forward; unsupported architectures are refused.

Families: Llama with Llama 3 RoPE scaling, Mistral (sliding window 64, shorter than the prompt), Qwen2,
Qwen3 (q/k norm), Gemma 3 text (sliding and full layers with their own RoPE tables, sandwich norms,
scaled embeddings), plus Gemma 3 with final logit soft-capping.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PhiConfig

from cachetune.runtime.decode import SamplingConfig, extend, generate_tokens
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.engine.selfcheck import run_self_check
from cachetune.methods.signals import linear_macs
from cachetune.model.adapter import ModelAdapter, UnsupportedModelError
from conftest import (
    _COMMON,
    VOCAB,
    all_selected,
    assert_cache_matches,
    assert_cache_matches_hf,
    assert_close,
    build_layout,
    generated_ids,
    hf_concat_reference,
    hf_forward,
    hf_partial_reference,
    none_selected,
    rand_ids,
    random_selected,
    rel_err,
)

TOL = 1e-4
FAMILIES = ["llama3_rope", "mistral", "qwen2", "qwen2_sliding", "qwen3", "qwen3_head24", "gemma3_text", "gemma3_text_softcap"]

@pytest.fixture(scope="module")
def pieces():
    return {
        "prefix": rand_ids(40, 21),
        "A": rand_ids(140, 22),
        "B": rand_ids(120, 23),
        "q": rand_ids(12, 24),
    }


def _parts(pieces, order=("prefix", "A", "B", "q")):
    return [(pieces[name], name in ("A", "B")) for name in order]


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_one_reproduces_hf_forward(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    layout, _ = build_layout(adapter, _parts(pieces, ("prefix", "B", "A", "q")))
    assert layout.total > 300
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = selective_prefill(adapter, layout, all_selected(layout), layout.total)
    assert_close(ref_logits[-1], res.logits, TOL, f"{family} logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_chunk_at_zero_ratio_zero_equals_full_forward(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    chunk = torch.cat([pieces["A"], pieces["B"], pieces["prefix"]])  # 300 tokens
    layout, _ = build_layout(adapter, [(chunk, True), (pieces["q"], False)])
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = selective_prefill(adapter, layout, none_selected(layout), layout.total)
    assert_close(ref_logits[-1], res.logits, TOL, f"{family} logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_equals_concatenated_independent_caches(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    parts = _parts(pieces)
    layout, _ = build_layout(adapter, parts)
    ref_logits, ks, vs = hf_concat_reference(model, parts)
    res = selective_prefill(adapter, layout, none_selected(layout), layout.total)
    assert_close(ref_logits, res.logits, TOL, f"{family} logits")
    assert_cache_matches(res, ks, vs, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_partial_selection_matches_hf_reference(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    parts = _parts(pieces)
    layout, _ = build_layout(adapter, parts)
    selections = random_selected(layout, 0.3, 4)
    ref_logits, ks, vs = hf_partial_reference(model, parts, selections)
    res = selective_prefill(adapter, layout, selections, layout.total)
    assert_close(ref_logits, res.logits, TOL, f"{family} logits")
    assert_cache_matches(res, ks, vs, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_after_selective_r1_matches_hf_generate(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    layout, _ = build_layout(adapter, _parts(pieces))
    ids = layout.input_ids
    out = model.generate(ids[None], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, ids.numel():].tolist()
    res = selective_prefill(adapter, layout, all_selected(layout), layout.total)
    decoded = generate_tokens(partial(extend, adapter, res.cache), res.logits, SamplingConfig(max_new_tokens=8), stop_ids=set())
    assert generated_ids(decoded) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_extend_after_selective_r1_matches_hf_forward(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    layout, _ = build_layout(adapter, _parts(pieces))
    forced = rand_ids(6, 97).tolist()
    n = layout.total
    ref_logits, _ = hf_forward(model, torch.cat([layout.input_ids, torch.tensor(forced)]))
    res = selective_prefill(adapter, layout, all_selected(layout), n)
    assert_close(ref_logits[n:], extend(adapter, res.cache, forced), TOL, f"{family} extend")


@pytest.mark.parametrize("family", FAMILIES)
def test_full_prefill_matches_hf_cache(tiny_adapter, pieces, family):
    """full_prefill (the r=1 baseline and the decode starting point) must hold every prompt row."""
    model, adapter = tiny_adapter(family)
    layout, _ = build_layout(adapter, _parts(pieces))
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = full_prefill(adapter, layout, layout.total)
    assert_close(ref_logits[-1], res.logits, TOL, f"{family} logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_extend_after_full_prefill_matches_hf_forward(tiny_adapter, pieces, family):
    model, adapter = tiny_adapter(family)
    layout, _ = build_layout(adapter, _parts(pieces))
    forced = rand_ids(4, 96).tolist()
    n = layout.total
    ref_logits, _ = hf_forward(model, torch.cat([layout.input_ids, torch.tensor(forced)]))
    res = full_prefill(adapter, layout, n)
    assert_close(ref_logits[n:], extend(adapter, res.cache, forced), TOL, f"{family} extend")


@pytest.mark.parametrize("family", ["llama"] + FAMILIES)
def test_self_check_passes(tiny_adapter, family):
    _, adapter = tiny_adapter(family)
    err = run_self_check(adapter, "fp", VOCAB)
    assert 0.0 <= err < 1e-4


def test_rope_scaling_is_really_exercised(tiny_adapter, pieces):
    """Llama 3 RoPE scaling changes the model: a Llama without it gives different logits."""
    scaled, _ = tiny_adapter("llama3_rope")
    plain, _ = tiny_adapter("llama")
    ids = torch.cat([pieces["prefix"], pieces["A"], pieces["B"]])
    a, _ = hf_forward(scaled, ids)
    b, _ = hf_forward(plain, ids)
    assert rel_err(a[-1], b[-1]) > 1e-2


def test_sliding_window_is_really_exercised(tiny_adapter, pieces):
    """With the window, far tokens are invisible: changing the first tokens must not change Mistral's
    last logits (prompt >> window), while it does for the Gemma 3 full-attention layer."""
    ids = torch.cat([pieces["prefix"], pieces["A"], pieces["B"]])
    other = ids.clone()
    other[:10] = rand_ids(10, 77)
    mistral, _ = tiny_adapter("mistral")
    # 3 layers x window 64: position T-1 sees back at most 3 * 63 tokens.
    assert rel_err(hf_forward(mistral, ids)[0][-1], hf_forward(mistral, other)[0][-1]) < 1e-6
    gemma, _ = tiny_adapter("gemma3_text")
    assert rel_err(hf_forward(gemma, ids)[0][-1], hf_forward(gemma, other)[0][-1]) > 1e-4


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_at_construction(rope_type):
    """RoPE whose tables depend on the sequence length would rotate a chunk's keys differently in
    every layout: the adapter refuses it outright, naming the variant."""
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=64)
    cfg = LlamaConfig(**{**_COMMON, "max_position_embeddings": 256, "head_dim": 16}, rope_parameters=params)
    with pytest.raises(UnsupportedModelError, match=rope_type):
        ModelAdapter(_tiny(cfg))


def _tiny(cfg):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize(
    "cfg,name",
    [
        (GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128), "gpt2"),
        (
            PhiConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
            ),
            "phi",
        ),
    ],
    ids=["gpt2", "phi"],
)
def test_unsupported_architecture_is_refused(cfg, name):
    with pytest.raises(UnsupportedModelError, match=repr(name)):
        ModelAdapter(_tiny(cfg))


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_macs_from_the_config_count_every_2d_weight_of_a_layer(tiny_adapter, family):
    """Deep focus's price counts a layer's linear maps from the model's config (vLLM's CPU build repacks
    the weights): on every family that count is the layer's own 2-D weights."""
    _, adapter = tiny_adapter(family)
    weights = sum(w.numel() for w in adapter.layers[0].parameters() if w.dim() == 2)
    assert linear_macs(adapter) == weights
