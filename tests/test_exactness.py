"""Exactness of selective prefill and decoding on a tiny Llama, against Hugging Face's own forward.

References are built with HF only:
- full recompute: HF forward of the whole prompt;
- full reuse (ratio 0): every chunk run alone through HF with position_ids at its global offset (RoPE
  is relative, so this is the chunk encoded alone with keys rotated where it lands), uncached text run
  through HF on top of a DynamicCache holding everything before it;
- partial reuse: HF forward of the whole prompt with hooks on k_proj / v_proj that overwrite the rows of
  non-recomputed chunk tokens with the chunk's independent (pre-RoPE) K/V. A position's state depends
  on other positions only through their K/V, so this is exactly "recompute the selected tokens in
  context, reuse the rest".
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from cachetune.engine.decode import SamplingConfig, extend, generate_tokens
from cachetune.engine.prefill import full_prefill, selective_prefill
from conftest import assert_close, build_layout, hf_forward, hf_layer_kv, rand_ids, rel_err

TOL = 1e-4
FAMILY = "llama"


# ----------------------------------------------------------------------------------------------------
# HF-only references (shared with test_families.py)


def _cache_from_rows(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> DynamicCache:
    """DynamicCache (all layers full) holding rotated keys/values given as [T, Hkv, D] per layer."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer)
    return cache


@torch.no_grad()
def hf_concat_reference(model, parts):
    """Full KV reuse built with HF only. parts: [(ids, cached)], last part uncached.

    Returns (last-token logits [vocab], keys, values) with keys/values lists of [T, Hkv, D] per layer.
    """
    num_layers = model.config.num_hidden_layers
    ks = [[] for _ in range(num_layers)]
    vs = [[] for _ in range(num_layers)]
    start, logits = 0, None
    for ids, cached in parts:
        n = ids.numel()
        pos = torch.arange(start, start + n)
        if cached:
            _, cache = hf_forward(model, ids, pos)  # the chunk alone, keys rotated at global positions
            new = [hf_layer_kv(cache, i) for i in range(num_layers)]
        else:
            past = _cache_from_rows([torch.cat(k) for k in ks], [torch.cat(v) for v in vs]) if start else None
            out, cache = hf_forward(model, ids, pos, cache=past)
            logits = out[-1]
            new = [(k[start:], v[start:]) for k, v in (hf_layer_kv(cache, i) for i in range(num_layers))]
        for i, (k, v) in enumerate(new):
            ks[i].append(k)
            vs[i].append(v)
        start += n
    return logits, [torch.cat(k) for k in ks], [torch.cat(v) for v in vs]


def _kv_modules(model):
    """Per layer: (module whose output is the pre-RoPE key, module whose output is the value)."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append((attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj, attn.v_proj))
    return out


@torch.no_grad()
def _capture_pre_rope(model, ids: torch.Tensor):
    """Independent (chunk alone, positions 0..n-1) pre-RoPE K and V outputs of every layer, via hooks."""
    captured, handles = {}, []
    for i, (kmod, vmod) in enumerate(_kv_modules(model)):
        handles.append(kmod.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(("k", i), o.clone())))
        handles.append(vmod.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(("v", i), o.clone())))
    try:
        hf_forward(model, ids)
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def hf_partial_reference(model, parts, selections):
    """Selective recompute built on HF's forward: rows of non-selected chunk tokens get independent K/V.

    parts: [(ids, cached)]; selections: per cached part, local indices recomputed in context.
    Returns (last-token logits [vocab], keys, values) like hf_concat_reference.
    """
    # global position -> (("k"/"v", layer) -> replacement row), collected per chunk
    replace_pos, sources = [], []
    start, sel_iter = 0, iter(selections)
    for ids, cached in parts:
        if cached:
            chosen = next(sel_iter)
            keep = torch.ones(ids.numel(), dtype=torch.bool)
            keep[chosen] = False
            local = keep.nonzero().flatten()
            replace_pos.append(start + local)
            sources.append((_capture_pre_rope(model, ids), local))
        start += ids.numel()
    handles = []

    def make_hook(kind, layer):
        def hook(module, args, output):
            output = output.clone()
            for pos, (captured, local) in zip(replace_pos, sources):
                output[0, pos] = captured[(kind, layer)][0, local]
            return output

        return hook

    for i, (kmod, vmod) in enumerate(_kv_modules(model)):
        handles.append(kmod.register_forward_hook(make_hook("k", i)))
        handles.append(vmod.register_forward_hook(make_hook("v", i)))
    try:
        logits, cache = hf_forward(model, torch.cat([ids for ids, _ in parts]))
    finally:
        for h in handles:
            h.remove()
    kv = [hf_layer_kv(cache, i) for i in range(model.config.num_hidden_layers)]
    return logits[-1], [k for k, _ in kv], [v for _, v in kv]


def assert_cache_matches(result, keys, values, tol=TOL, rows=None, what=""):
    """Compare PrefillResult.cache rows (all, or `rows`) with reference per-layer [T, Hkv, D]."""
    n = keys[0].shape[0]
    assert result.cache.length == n
    idx = torch.arange(n) if rows is None else rows
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert_close(k[idx], result.cache.keys[layer, :n][idx], tol, f"{what} keys layer {layer}")
        assert_close(v[idx], result.cache.values[layer, :n][idx], tol, f"{what} values layer {layer}")


def all_selected(layout):
    return [torch.arange(seg.token_ids.numel()) for _, seg in layout.chunk_segments]


def none_selected(layout):
    return [torch.empty(0, dtype=torch.int64) for _ in layout.chunk_segments]


def random_selected(layout, ratio: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _, seg in layout.chunk_segments:
        n = seg.token_ids.numel()
        out.append(torch.randperm(n, generator=g)[: int(round(ratio * n))].sort().values)
    return out


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


# ----------------------------------------------------------------------------------------------------
# Ratio 1.0: the model's own forward, logits and the whole KV cache


@pytest.mark.parametrize(
    "order",
    [BASE, ["prefix", "C", "A", "B", "q"], ["long_prefix", "B", "C", "A", "q"], ["A", "q", "B", "C", "q"]],
    ids=["base", "reordered", "longer-prefix-reordered", "chunk-first-text-between"],
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
    kv = [hf_layer_kv(ref_cache, i) for i in range(adapter.num_layers)]
    assert_cache_matches(res, [k for k, _ in kv], [v for _, v in kv], what="r=1")
    assert res.prompt_tokens == layout.total
    assert res.computed_tokens == layout.total
    assert res.recomputed_chunk_tokens == sum(seg.token_ids.numel() for _, seg in layout.chunk_segments)


def test_full_prefill_matches_hf_forward_and_cache(llama, pieces):
    model, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    ref_logits, ref_cache = hf_forward(model, layout.input_ids)
    res = full_prefill(adapter, layout, layout.total + 4)
    assert_close(ref_logits[-1], res.logits, TOL, "logits")
    kv = [hf_layer_kv(ref_cache, i) for i in range(adapter.num_layers)]
    assert_cache_matches(res, [k for k, _ in kv], [v for _, v in kv], what="full_prefill")


# ----------------------------------------------------------------------------------------------------
# Ratio 0: plain concatenation of independently encoded chunk caches, rotated to their positions


@pytest.mark.parametrize(
    "order",
    [BASE, ["prefix", "C", "A", "B", "q"], ["long_prefix", "B", "C", "A", "q"], ["A", "q", "B", "C", "q"]],
    ids=["base", "reordered", "longer-prefix-reordered", "chunk-first-text-between"],
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
    kv = [hf_layer_kv(ref_cache, i) for i in range(adapter.num_layers)]
    assert_cache_matches(res, [k for k, _ in kv], [v for _, v in kv], what="chunk@0 r=0")
    assert res.computed_tokens == pieces["q"].numel()


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
    res = selective_prefill(adapter, layout, selections, layout.total, prefetch=prefetch)
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


def generated_ids(decoded) -> list[int]:
    """generate_tokens returns the id list (older versions: an object with .ids)."""
    return list(getattr(decoded, "ids", decoded))


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
    decoded = generate_tokens(adapter, res.cache, res.logits, SamplingConfig(max_new_tokens=8), stop_ids=set())
    assert generated_ids(decoded) == expected
    assert res.cache.length == layout.total + 7  # the 8th token is sampled, never fed back


def test_generation_stops_at_stop_id(llama, pieces):
    model, adapter = llama
    layout, _ = build_layout(adapter, parts_of(pieces, BASE))
    expected = _hf_greedy(model, layout.input_ids, 8)
    stop = expected[3]
    k = expected.index(stop)
    res = selective_prefill(adapter, layout, all_selected(layout), layout.total)
    decoded = generate_tokens(adapter, res.cache, res.logits, SamplingConfig(max_new_tokens=8), stop_ids={stop})
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
    ref, _ = hf_forward(model, forced, torch.arange(n, n + 6), cache=_cache_from_rows(ks, vs))
    res = selective_prefill(adapter, layout, selections, n)
    got = extend(adapter, res.cache, forced.tolist())
    assert_close(ref, got, TOL, f"extend after r={ratio}")
