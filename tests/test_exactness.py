"""Exactness of selective prefill and decoding on a tiny Llama, against Hugging Face's own forward.

References are HF-only; see the hf_*_reference builders in conftest.py.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from cachetune.runtime.decode import SamplingConfig, extend, generate_tokens
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.runtime.loading import Pipeline
from conftest import (
    hf_cache_from_rows,
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
FAMILY = "llama"


# ----------------------------------------------------------------------------------------------------
# Fixtures: one Llama and a prompt  prefix(20) | A(150) | B(130) | C(90) | question(15)  = 405 tokens


@pytest.fixture(scope="module")
def llama(tiny_adapter):
    return tiny_adapter(FAMILY)


@pytest.fixture(scope="module")
def pieces():
    return {
        "prefix": rand_ids(20, 11),
        "long_prefix": rand_ids(70, 12),
        "A": rand_ids(150, 13),
        "B": rand_ids(130, 14),
        "C": rand_ids(90, 15),
        "q": rand_ids(15, 16),
    }


def parts_of(pieces, order):
    return [(pieces[name], name in "ABC") for name in order]


BASE = ["prefix", "A", "B", "C", "q"]
ORDERS = [
    BASE,
    ["prefix", "C", "A", "B", "q"],
    ["long_prefix", "B", "C", "A", "q"],
    ["A", "q", "B", "C", "q"],
    ["prefix", "A", "B", "A", "q"],
]
ORDER_IDS = ["base", "reordered", "longer-prefix-reordered", "chunk-first-text-between", "same-chunk-twice"]


# ----------------------------------------------------------------------------------------------------
# Ratio 1.0: the model's own forward, logits and the whole KV cache


@pytest.mark.parametrize(
    "order",
    ORDERS,
    ids=ORDER_IDS,
)
def test_ratio_one_reproduces_full_forward_and_cache(llama, pieces, order):
    model, adapter = llama
    parts = parts_of(pieces, order)
    layout, _ = build_layout(adapter, parts)
    ids = layout.input_ids
    assert layout.total > 300
    ref_logits, ref_cache = hf_forward(model, ids)
    res = selective_prefill(adapter, layout, all_selected(layout), layout.total + 8)
    assert_close(ref_logits[-1], res.logits, TOL, "logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what="r=1")
    assert res.prompt_tokens == layout.total
    assert res.computed_tokens == layout.total
    assert res.recomputed_chunk_tokens == sum(seg.token_ids.numel() for _, seg in layout.chunk_segments)


def test_full_prefill_matches_hf_forward_and_cache(llama, pieces):
    model, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = full_prefill(adapter, layout, layout.total + 4)
    assert_close(ref_logits[-1], res.logits, TOL, "logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what="full_prefill")


# ----------------------------------------------------------------------------------------------------
# Ratio 0: plain concatenation of independently encoded chunk caches, rotated to their positions


@pytest.mark.parametrize(
    "order",
    ORDERS,
    ids=ORDER_IDS,
)
def test_ratio_zero_equals_concatenated_independent_caches(llama, pieces, order):
    model, adapter = llama
    parts = parts_of(pieces, order)
    layout, _ = build_layout(adapter, parts)
    ref_logits, ks, vs = hf_concat_reference(model, parts)
    res = selective_prefill(adapter, layout, none_selected(layout), layout.total)
    assert_close(ref_logits, res.logits, TOL, "logits")
    assert_cache_matches(res, ks, vs, what="r=0")
    uncached = sum(ids.numel() for ids, cached in parts if not cached)
    assert res.computed_tokens == uncached and res.recomputed_chunk_tokens == 0
    # Reuse must actually differ from full recompute here, or this test could not tell them apart.
    full_logits, _ = hf_forward(model, layout.input_ids)
    assert rel_err(full_logits[-1], res.logits) > 1e-2


def test_single_chunk_at_position_zero_ratio_zero_equals_full_prefill(llama, pieces):
    model, adapter = llama
    chunk = torch.cat([pieces["A"], pieces["B"], pieces["C"]])  # 370 tokens, one chunk
    layout, _ = build_layout(adapter, [(chunk, True), (pieces["q"], False)])
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = selective_prefill(adapter, layout, none_selected(layout), layout.total)
    assert_close(ref_logits[-1], res.logits, TOL, "logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what="chunk@0 r=0")
    assert res.computed_tokens == pieces["q"].numel()


def test_prompt_without_cached_chunks_is_plain_forward(llama, pieces):
    model, adapter = llama
    layout, _ = build_layout(adapter, [(torch.cat([pieces["long_prefix"], pieces["A"], pieces["B"]]), False)])
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = selective_prefill(adapter, layout, [], layout.total)
    assert_close(ref_logits[-1], res.logits, TOL, "logits")
    assert_cache_matches_hf(res, ref_cache, adapter.num_layers, what="no chunks")


def test_same_chunk_objects_reused_at_new_positions(llama, pieces):
    """One store, two requests: the stored (pre-RoPE) chunks must serve both layouts exactly."""
    model, adapter = llama
    first = parts_of(pieces, BASE)
    _, store = build_layout(adapter, first)
    second = parts_of(pieces, ["long_prefix", "C", "B", "A", "q"])
    layout, _ = build_layout(adapter, second, store)
    assert len(store) == 3  # nothing was re-encoded under a new id
    ref_logits, ks, vs = hf_concat_reference(model, second)
    res = selective_prefill(adapter, layout, none_selected(layout), layout.total)
    assert_close(ref_logits, res.logits, TOL, "logits")
    assert_cache_matches(res, ks, vs, what="second request")


# ----------------------------------------------------------------------------------------------------
# Partial selection


def test_hook_reference_agrees_with_concat_reference(llama, pieces):
    """Sanity check of the partial-selection reference itself at ratio 0."""
    model, _ = llama
    parts = parts_of(pieces, BASE)
    l1, k1, v1 = hf_concat_reference(model, parts)
    l2, k2, v2 = hf_partial_reference(model, parts, [torch.empty(0, dtype=torch.int64)] * 3)
    assert_close(l1, l2, TOL, "logits")
    for layer in range(len(k1)):
        assert_close(k1[layer], k2[layer], TOL, f"keys {layer}")
        assert_close(v1[layer], v2[layer], TOL, f"values {layer}")


@pytest.mark.parametrize("ratio,seed", [(0.3, 0), (0.15, 1), (0.7, 2)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_partial_selection_matches_hf_reference(llama, pieces, ratio, seed, prefetch):
    model, adapter = llama
    parts = parts_of(pieces, ["long_prefix", "B", "A", "C", "q"])
    layout, _ = build_layout(adapter, parts)
    selections = random_selected(layout, ratio, seed)
    ref_logits, ks, vs = hf_partial_reference(model, parts, selections)
    res = selective_prefill(adapter, layout, selections, layout.total, pipeline=Pipeline(overlap=prefetch))
    assert_close(ref_logits, res.logits, TOL, "logits")
    assert_cache_matches(res, ks, vs, what=f"r={ratio}")
    assert res.recomputed_chunk_tokens == sum(s.numel() for s in selections)
    assert res.computed_tokens == res.recomputed_chunk_tokens + 70 + 15


def test_partial_selection_cache_rows(llama, pieces):
    """Invariant: unselected chunk rows are exactly the independent K/V re-rotated to their global
    positions; selected rows (beyond layer 0, after preceding context) are recomputed, i.e. differ."""
    model, adapter = llama
    parts = parts_of(pieces, BASE)
    layout, _ = build_layout(adapter, parts)
    selections = random_selected(layout, 0.3, 7)
    _, ks, vs = hf_concat_reference(model, parts)  # independent chunk K/V at global positions
    res = selective_prefill(adapter, layout, selections, layout.total)
    unselected, selected = [], []
    for (start, seg), chosen in zip(layout.chunk_segments, selections):
        mask = torch.zeros(seg.token_ids.numel(), dtype=torch.bool)
        mask[chosen] = True
        selected.append(start + mask.nonzero().flatten())
        unselected.append(start + (~mask).nonzero().flatten())
    unselected, selected = torch.cat(unselected), torch.cat(selected)
    assert_cache_matches(res, ks, vs, rows=unselected, what="unselected rows")
    n = layout.total
    for layer in range(1, adapter.num_layers):
        got = res.cache.keys[layer, :n][selected]
        assert torch.isfinite(got).all()
        assert rel_err(ks[layer][selected], got) > 1e-3, f"layer {layer}: selected keys were not recomputed"


def test_selection_order_is_irrelevant(llama, pieces):
    """Selections are sets of local indices: an unsorted selection must give the sorted result."""
    _, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    selections = random_selected(layout, 0.3, 3)
    a = selective_prefill(adapter, layout, selections, layout.total)
    b = selective_prefill(adapter, layout, [s.flip(0) for s in selections], layout.total)
    assert_close(a.logits, b.logits, 1e-6, "logits")


def test_wrong_number_of_selections_rejected(llama, pieces):
    _, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    with pytest.raises(ValueError):
        selective_prefill(adapter, layout, all_selected(layout)[:2], layout.total)


# ----------------------------------------------------------------------------------------------------
# Decoding


def _hf_greedy(model, ids, n):
    out = model.generate(ids[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.numel():].tolist()


@pytest.mark.parametrize("how", ["full_prefill", "selective_r1"])
@pytest.mark.parametrize("room", [0, 16], ids=["cache-grows", "roomy"])
def test_greedy_generation_matches_hf_generate(llama, pieces, how, room):
    model, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    expected = _hf_greedy(model, layout.input_ids, 8)
    assert len(expected) == 8
    if how == "full_prefill":
        res = full_prefill(adapter, layout, layout.total + room)
    else:
        res = selective_prefill(adapter, layout, all_selected(layout), layout.total + room)
    decoded = generate_tokens(partial(extend, adapter, res.cache), res.logits, SamplingConfig(max_new_tokens=8), stop_ids=set())
    assert generated_ids(decoded) == expected
    assert res.cache.length == layout.total + 7  # the 8th token is sampled, never fed back


def test_generation_stops_at_stop_id(llama, pieces):
    model, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    expected = _hf_greedy(model, layout.input_ids, 8)
    stop = expected[3]
    k = expected.index(stop)
    res = selective_prefill(adapter, layout, all_selected(layout), layout.total)
    decoded = generate_tokens(partial(extend, adapter, res.cache), res.logits, SamplingConfig(max_new_tokens=8), stop_ids={stop})
    assert generated_ids(decoded) == expected[:k]


@pytest.mark.parametrize("how", ["full_prefill", "selective_r1"])
def test_extend_teacher_forcing_matches_hf_forward(llama, pieces, how):
    model, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    forced = rand_ids(9, 99).tolist()
    ref_logits, _ = hf_forward(model, torch.cat([layout.input_ids, torch.tensor(forced)]))
    n = layout.total
    if how == "full_prefill":
        res = full_prefill(adapter, layout, n)
    else:
        res = selective_prefill(adapter, layout, all_selected(layout), n)
    assert_close(ref_logits[n - 1], res.logits, TOL, "prefill logits")
    got_a = extend(adapter, res.cache, forced[:5])  # several tokens in one call
    got_b = torch.cat([extend(adapter, res.cache, [t]) for t in forced[5:]])  # then one at a time
    assert_close(ref_logits[n : n + 5], got_a, TOL, "extend x5")
    assert_close(ref_logits[n + 5 : n + 9], got_b, TOL, "extend x1")
    assert res.cache.length == n + 9


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_extend_after_reuse_matches_hf_on_reference_cache(llama, pieces, ratio):
    """Decoding on top of a reused cache: HF forward of the new tokens over the HF-built reuse cache."""
    model, adapter = llama
    parts = parts_of(pieces, ["long_prefix", "C", "A", "B", "q"])
    layout, _ = build_layout(adapter, parts)
    selections = random_selected(layout, ratio, 5)
    _, ks, vs = hf_partial_reference(model, parts, selections)
    forced = torch.tensor(rand_ids(6, 98).tolist())
    n = layout.total
    ref, _ = hf_forward(model, forced, torch.arange(n, n + 6), cache=hf_cache_from_rows(ks, vs))
    res = selective_prefill(adapter, layout, selections, n)
    got = extend(adapter, res.cache, forced.tolist())
    assert_close(ref, got, TOL, f"extend after r={ratio}")
