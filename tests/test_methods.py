"""Each baseline's defining behaviour, on a tiny random Llama against HF or a by-hand reference."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from cachetune.chunks.rankers import ChunkView, get_ranker
from cachetune.config import EngineConfig
from cachetune.methods.ape import APESettings, ape_attention, ape_prefill
from cachetune.runtime.decode import SamplingConfig, extend, generate_tokens
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import full_prefill, prefix_prefill, pruned_prefill, selective_prefill
from cachetune.runtime import prefix_cache
from cachetune.runtime.prefix_cache import PrefixCache
from cachetune.methods import SelectionRequest, SelectiveMethod, make_method, method_names, split_global_top
from cachetune.methods.allocation import allocate, proportional_quotas
from cachetune.methods.cachetune import SHORT_CHUNKS, SHORT_WITHIN
from cachetune.methods.signals import PRICE_SCALE, deep_focus_price, observe_reuse, question_attention, signal_adapter
from cachetune.model.adapter import fast_bfloat16
from conftest import assert_close, build_layout, hf_forward, none_selected, rand_ids

TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tiny_adapter):
    return tiny_adapter("llama")


def _parts(prefix=12, chunks=(40, 33, 50), question=9, seed=0):
    parts = [(rand_ids(prefix, seed), False)]
    parts += [(rand_ids(n, seed + 1 + i), True) for i, n in enumerate(chunks)]
    return parts + [(rand_ids(question, seed + 99), False)]


class _Rankings:
    """A RankingSource without an engine: K/V-only rankers on the stored chunk, default `lf`."""

    def __init__(self, adapter):
        self.adapter = adapter

    def ranker(self, spec=None):
        return get_ranker(spec or "lf")

    def scores(self, chunk, spec=None):
        every = torch.arange(chunk.num_tokens)
        kv = [chunk.load_layer(layer, every) for layer in range(self.adapter.num_layers)]
        view = ChunkView(chunk.token_ids, torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]))
        return self.ranker(spec).scores(view)


def _request(adapter, layout, price_scale=None):
    return SelectionRequest(layout, adapter, _Rankings(adapter), price_scale=price_scale)


def _select(name, adapter, layout, ratio, price_scale=None):
    return make_method(name).selector.select(_request(adapter, layout, price_scale), ratio)


# Deep focus in full, as the default runs it on a request it sends deep.
DEEP_SPEC = ("cachetune:first:allocation=focus:start_share=0.5:signal=question:signal_layers={layers}"
             ":signal_tokens=none:signal_dtype=auto")
SELECTIVE = [name for name in method_names() if isinstance(make_method(name), SelectiveMethod)]


def _check_selection_contract(selections, layout):
    assert len(selections) == len(layout.chunk_segments)
    for sel, (_, seg) in zip(selections, layout.chunk_segments):
        assert sel.dtype == torch.int64
        assert torch.equal(sel, torch.unique(sel))
        assert sel.numel() == 0 or (0 <= int(sel[0]) and int(sel[-1]) < seg.chunk.num_tokens)


@pytest.mark.parametrize("name", SELECTIVE)
@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_every_selector_keeps_the_contract(llama, name, ratio):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    _check_selection_contract(_select(name, adapter, layout, ratio), layout)


@pytest.mark.parametrize("name", ["cachetune", "cacheblend", "prophetkv", "random", "l2", "highfreq"])
def test_ratio_one_of_budgeted_selectors_reproduces_full_prefill(llama, name):
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    sel = _select(name, adapter, layout, 1.0)
    got = selective_prefill(adapter, layout, sel, layout.total)
    ref, _ = hf_forward(model, layout.input_ids)
    assert_close(ref[-1], got.logits, TOL, name)


def test_budgeted_selectors_spend_round_ratio_of_chunk_tokens(llama):
    """One budget per request, round(ratio x chunk tokens), whatever the allocation."""
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=(40, 33, 50, 7)))
    lengths = [seg.chunk.num_tokens for _, seg in layout.chunk_segments]
    budget = round(0.2 * sum(lengths) + 1e-9)
    names = ["cacheblend", "prophetkv", "cacheslide", "cachetune", "random", "l2", "highfreq", "lf_only",
             *SELECTION_VARIANTS]
    for name in names:
        assert sum(s.numel() for s in _select(name, adapter, layout, 0.2)) == budget, name
    # proportional (cachetune's default): each chunk's share follows its length
    sel = _select("cachetune:lf:allocation=proportional", adapter, layout, 0.2)
    assert [s.numel() for s in sel] == proportional_quotas(lengths, budget)


# Every allocation, with and without the question signal, and the settings that change its pass.
SELECTION_VARIANTS = ["cachetune:first:allocation=spread:start_share=0.75:signal=none",
                      "cachetune:lf:allocation=spread:signal=none",
                      "cachetune:first:allocation=proportional:signal=question:signal_layers=1",
                      "cachetune:first:allocation=spread:signal=question:signal_tokens=2",
                      "cachetune:first:allocation=spread:start_share=0.75:signal=question:signal_tokens=none",
                      "cachetune:first:allocation=focus:start_share=0.5:signal=question:signal_layers=99"
                      ":signal_tokens=0",
                      "cachetune:first:allocation=focus:signal=question:signal_dtype=bfloat16",
                      "cachetune:first:allocation=focus:start_share=0.5:signal=question:signal_dtype=int8",
                      "cachetune:first:allocation=focus:signal=question:deep_within=1"]


@pytest.mark.parametrize("name", SELECTION_VARIANTS)
def test_every_allocation_and_signal_at_ratio_one_reproduces_full_prefill(llama, name):
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    sel = _select(name, adapter, layout, 1.0)
    _check_selection_contract(sel, layout)
    got = selective_prefill(adapter, layout, sel, layout.total)
    ref, _ = hf_forward(model, layout.input_ids)
    assert_close(ref[-1], got.logits, TOL, name)


@pytest.mark.parametrize("name", SELECTION_VARIANTS)
def test_every_allocation_and_signal_at_ratio_zero_is_full_reuse(llama, name):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    assert all(s.numel() == 0 for s in _select(name, adapter, layout, 0.0))


@pytest.mark.parametrize("name", SELECTION_VARIANTS)
def test_every_allocation_and_signal_selects_nothing_when_no_chunk_is_reused(llama, name):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=()))
    assert _select(name, adapter, layout, 0.15) == []


def test_spread_recomputes_every_chunk_start_with_or_without_the_signal(llama):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=(40, 10, 50)))
    # budget round(0.3 x 100) = 30; half of it (15) on starts: 5 first tokens of each chunk
    for signal in ("none", "question"):
        sel = _select(f"cachetune:first:allocation=spread:start_share=0.5:signal={signal}", adapter, layout, 0.3)
        for s in sel:
            assert s[:5].tolist() == [0, 1, 2, 3, 4], signal


def _question_attention_reference(model, adapter, layers):
    """A 60-token chunk at position 0 and a 10-token question: (layout, HF's attention of the question
    rows to the chunk [60], averaged over heads, question rows and the first `layers` layers)."""
    layout, _ = build_layout(adapter, [(rand_ids(60, 1), True), (rand_ids(10, 2), False)])
    model.config._attn_implementation = "eager"
    try:
        out = model(input_ids=layout.input_ids[None].to(model.device), output_attentions=True)
    finally:
        model.config._attn_implementation = "sdpa"
    attn = torch.stack(out.attentions[:layers])[:, 0]  # [layers, heads, T, T]
    return layout, attn[:, :, 60:, :60].mean(dim=(0, 1, 2))


@pytest.mark.parametrize("layers", [1, 2])
def test_question_signal_is_the_questions_attention_over_the_first_layers(llama, layers):
    """One chunk at position 0: full reuse is exact, so HF's own attention is the reference."""
    model, adapter = llama
    layout, expected = _question_attention_reference(model, adapter, layers)
    got, _ = question_attention(adapter, layout, layers)
    assert_close(expected, got[0], 1e-5, "question attention")


@pytest.mark.parametrize("layers,dtype", [(1, "model"), (3, "model"), (3, "bfloat16")])
def test_prefill_continuing_from_the_question_pass_equals_a_fresh_one(llama, layers, dtype):
    """The question pass keeps its first layers' reused rows; the prefill that continues from them
    gives the same KV and logits as one that loads everything itself, whatever dtype the pass ran in."""
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    scores, prefilled = question_attention(adapter, layout, layers, capacity=layout.total + 5, dtype=dtype)
    selections = allocate(scores, 0.3, "spread", comparable=True)
    fresh = selective_prefill(adapter, layout, selections, layout.total + 5)
    continued = selective_prefill(adapter, layout, selections, layout.total + 5, prefilled=prefilled)
    assert torch.equal(fresh.logits, continued.logits)
    n = layout.total
    assert torch.equal(fresh.cache.keys[:, :n], continued.cache.keys[:, :n])
    assert torch.equal(fresh.cache.values[:, :n], continued.cache.values[:, :n])


@pytest.mark.parametrize("between", [False, True])
def test_the_pass_reusing_its_observed_probabilities_gives_the_plain_passs_scores(llama, between):
    """The question pass takes the question's attention output from the probabilities its observer
    computed (no second query-key product): the scores match the pass with causal attention to
    float32 rounding, with uncached text before the chunks and between them too."""
    _, adapter = llama
    parts = _parts()
    if between:
        parts.insert(2, (rand_ids(7, 50), False))
    layout, _ = build_layout(adapter, parts)
    plain, _ = question_attention(adapter, layout, 3, reuse_probs=False)
    reused, _ = question_attention(adapter, layout, 3)
    # Layers 1 and 2's scores read the question's output of layers 0 and 1, which the reuse computes.
    assert_close(torch.cat(plain), torch.cat(reused), 1e-5, "question attention, probabilities reused")


def test_the_question_signal_in_bfloat16_approximates_its_float32_scores(llama):
    """The question's pass on layers cast to bfloat16 (signal_dtype) gives the float32 pass's scores
    within bfloat16's precision, while the model itself stays float32."""
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    exact, _ = question_attention(adapter, layout, 3)
    approx, _ = question_attention(adapter, layout, 3, dtype="bfloat16")
    assert_close(torch.cat(exact), torch.cat(approx), 2e-2, "question attention in bfloat16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cast = adapter.cast(2, torch.bfloat16)
    assert (cast.dtype, cast.num_layers, adapter.dtype) == (torch.bfloat16, 2, torch.float32)
    assert cast.layers[0] is adapter.cast(3, torch.bfloat16).layers[0]  # cast once, shared
    assert adapter.cast(3, torch.float32) is adapter


def test_auto_signal_dtype_is_bfloat16_only_where_it_is_fast(llama):
    _, adapter = llama
    auto = signal_adapter(adapter, 2, "auto")
    assert auto.dtype == (torch.bfloat16 if fast_bfloat16(adapter.device) else adapter.dtype)
    assert signal_adapter(adapter, 2, "model") is adapter
    with pytest.raises(ValueError, match="signal_dtype"):
        make_method("cachetune:first:allocation=spread:signal=question:signal_dtype=int4")


@pytest.mark.parametrize("price_scale", [None, 0.5, 2.0])
def test_deep_within_takes_deep_focus_where_it_is_cheap_and_its_own_settings_elsewhere(llama, price_scale):
    """A request whose predicted deep-focus price times the machine's scale (PRICE_SCALE where it has
    no calibration) is within `deep_within` picks exactly what deep focus (every layer, start share 0.5,
    no cap, the pass in `auto`) picks; above it, or with deep_within 0, what the settings pick."""
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=(90, 70, 120)))
    price = (PRICE_SCALE if price_scale is None else price_scale) * deep_focus_price(adapter, layout, 0.3, "auto")
    assert 0 < price < 0.99
    base = ("cachetune:first:allocation=focus:start_share=0.8:signal=question:signal_layers=1:signal_tokens=1"
            ":short_chunks=0")
    own = f"{base}:deep_within=0"
    deep = DEEP_SPEC.format(layers=adapter.num_layers)
    picks = {name: _select(name, adapter, layout, 0.3) for name in (own, deep)}
    assert any(not torch.equal(a, b) for a, b in zip(picks[own], picks[deep]))  # the two choices differ here
    for within, expected in [(price * 1.01, deep), (price * 0.99, own), (0, own), ("none", own)]:
        got = _select(f"{base}:deep_within={within}", adapter, layout, 0.3, price_scale)
        assert all(torch.equal(a, b) for a, b in zip(got, picks[expected])), within


@pytest.mark.parametrize("chunks,within", [((600,), EngineConfig.deep_within), ((90, 70, 120), SHORT_WITHIN)])
def test_the_default_selection_takes_deep_focus_within_the_share_for_its_chunk_lengths(llama, chunks, within):
    """Plain `cachetune` is focus with deep focus where its price is within EngineConfig.deep_within
    on chunks averaging more than SHORT_CHUNKS tokens and within SHORT_WITHIN on shorter ones (here
    the machine's scale moves the price across it); the engine's config can switch it off, and a
    selection other than focus with the question signal ignores the setting."""
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=chunks))
    assert (sum(chunks) <= SHORT_CHUNKS * len(chunks)) == (within == SHORT_WITHIN)
    price = deep_focus_price(adapter, layout, 0.3, "auto")
    deep = DEEP_SPEC.format(layers=adapter.num_layers)
    focus = "cachetune:deep_within=0"
    picks = {name: _select(name, adapter, layout, 0.3) for name in (deep, focus)}
    assert any(not torch.equal(a, b) for a, b in zip(picks[deep], picks[focus]))
    for scale, expected in [(0.99 * within / price, deep), (1.01 * within / price, focus)]:
        got = _select("cachetune", adapter, layout, 0.3, scale)
        assert all(torch.equal(a, b) for a, b in zip(got, picks[expected])), scale
    off = make_method("cachetune", EngineConfig(deep_within=0)).selector.select(
        _request(adapter, layout, 0.99 * within / price), 0.3)
    assert all(torch.equal(a, b) for a, b in zip(off, picks[focus]))
    spread = "cachetune:first:allocation=spread:signal=question"
    assert all(torch.equal(a, b) for a, b in zip(_select(f"{spread}:deep_within=1", adapter, layout, 0.3, 0.01),
                                                  _select(f"{spread}:deep_within=0", adapter, layout, 0.3)))


@pytest.mark.parametrize("settings,deep", [("short_chunks=94:short_within=HIGH", True),
                                           ("short_chunks=94:short_within=LOW", False),
                                           ("short_chunks=93:short_within=HIGH", False),
                                           ("short_chunks=none:short_within=HIGH", False),
                                           ("short_chunks=94:short_within=HIGH:deep_within=0", False)])
def test_short_chunks_take_deep_focus_within_their_own_price_limit(llama, settings, deep):
    """A request whose chunks average at most `short_chunks` tokens (here 280/3 = 93.3) takes deep
    focus where its price is within `short_within`, though above `deep_within`; longer chunks, no
    `short_chunks`, or deep focus switched off (deep_within 0) keep the settings' own selection."""
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=(90, 70, 120)))
    price = PRICE_SCALE * deep_focus_price(adapter, layout, 0.3, "auto")
    base = "cachetune:first:allocation=focus:start_share=0.8:signal=question:signal_layers=1:signal_tokens=1"
    if "deep_within" not in settings:
        base += f":deep_within={price / 2}"
    own = f"{base}:short_chunks=0"
    picks = {True: _select(DEEP_SPEC.format(layers=adapter.num_layers), adapter, layout, 0.3),
             False: _select(own, adapter, layout, 0.3)}
    assert any(not torch.equal(a, b) for a, b in zip(picks[True], picks[False]))  # the two choices differ here
    spec = f"{base}:{settings.replace('HIGH', str(price * 1.01)).replace('LOW', str(price * 0.99))}"
    got = _select(spec, adapter, layout, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, picks[deep]))


def test_deep_focus_price_is_one_at_ratio_zero_and_falls_with_the_ratio_and_rises_with_extra_attention(llama):
    """At r = 0 `first` computes the uncached text alone, the work of the deep pass in the model's own
    dtype: the price is exactly 1 without extra attention. More recompute makes `first` dearer (the
    price falls); the picks' extra attention only adds to it; a pass in bfloat16 costs no more."""
    _, adapter = llama
    layout, _ = build_layout(adapter, [(rand_ids(5, 0), False), (rand_ids(40, 1), True), (rand_ids(3, 2), False)])
    assert deep_focus_price(adapter, layout, 0.0, "model", extra_attention=0.0) == pytest.approx(1.0)
    prices = [deep_focus_price(adapter, layout, r, "model") for r in (0.05, 0.15, 0.3, 0.6, 1.0)]
    assert prices == sorted(prices, reverse=True) and len(set(prices)) == len(prices)
    extra = [deep_focus_price(adapter, layout, 0.25, "model", extra_attention=e) for e in (0.0, 0.25, 0.5)]
    assert extra[0] < extra[1] < extra[2]
    assert extra[2] - extra[1] == pytest.approx(extra[1] - extra[0])  # in proportion to the extra share
    assert deep_focus_price(adapter, layout, 0.25, "bfloat16") <= deep_focus_price(adapter, layout, 0.25, "model")


def test_the_question_signal_with_int8_weights_approximates_its_float32_scores(llama):
    """signal_dtype=int8: the pass's linear layers in int8 (on a CPU), scores within int8's precision
    of the float32 pass's, the model itself untouched."""
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    exact, _ = question_attention(adapter, layout, 3)
    approx, _ = question_attention(adapter, layout, 3, dtype="int8")
    assert_close(torch.cat(exact), torch.cat(approx), 5e-2, "question attention with int8 weights")
    assert not torch.equal(torch.cat(exact), torch.cat(approx))  # the pass did run in int8
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cast = signal_adapter(adapter, 2, "int8")
    assert (cast.dtype, cast.num_layers) == (signal_adapter(adapter, 2, "auto").dtype, 2)
    assert not any(isinstance(m, torch.nn.Linear) for layer in cast.layers for m in layer.modules())


def test_an_observing_pass_skips_only_what_no_one_reads(llama):
    """observe_reuse stops its last layer after K/V and observe: every layer's keys and the question's
    queries it observes equal those of a pass that runs one layer more."""
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    seen = {2: [], 3: []}
    for layers in seen:
        observe_reuse(adapter, layout, layers, lambda layer, q, keys, out=seen[layers]: out.append((q, keys)))
    assert [len(seen[2]), len(seen[3])] == [2, 3]
    for (q2, k2), (q3, k3) in zip(seen[2], seen[3]):
        assert torch.equal(q2, q3) and torch.equal(k2, k3)


def test_method_names_carry_settings():
    m = make_method("cachetune:first:allocation=spread:start_share=0.25:signal=question")
    assert (m.settings.ranking, m.settings.allocation, m.settings.start_share, m.settings.signal) == \
        ("first", "spread", 0.25, "question")
    assert make_method("epic:k=4").settings.k == 4
    assert make_method("cachetune:allocation=spread").settings.ranking == "first"
    for bad, why in [("epic:allocation=spread", "no setting"), ("epic:k=four", "not of type int"),
                     ("cachetune:allocation=sideways", "unknown allocation"),
                     ("cachetune:start_share=2", "start_share must be"),
                     ("cachetune:signal=psychic", "unknown signal"),
                     ("cachetune:first:allocation=focus:signal=none", "focus allocation needs"),
                     ("cachetune:first:allocation=focus:signal=question:deep_within=1.5", "deep_within must be")]:
        with pytest.raises(ValueError, match=why):
            make_method(bad)


def test_rejected_settings_are_no_settings():
    """Measured and rejected (docs/results.md, "What we tried that did not work"): gone, not ignored."""
    for bad, why in [("cachetune:first:signal=question:decay=1", "no setting 'decay'"),
                     ("cachetune:first:signal=question:signal_max_chunk=384", "no setting 'signal_max_chunk'"),
                     ("cachetune:first:signal=question:signal_pool=2", "no setting 'signal_pool'"),
                     ("cachetune:first:allocation=spread:signal=attended", "unknown signal"),
                     ("cachetune:first:allocation=spread:signal=deviation", "unknown signal"),
                     ("cachetune:first:allocation=equal", "unknown allocation"),
                     ("cachetune:first:allocation=starts:signal=question", "unknown allocation"),
                     ("cachetune:first:allocation=global:signal=question", "unknown allocation")]:
        with pytest.raises(ValueError, match=why):
            make_method(bad)
    with pytest.raises(ValueError, match="signal must be one of"):
        EngineConfig(signal="attended")


def test_the_default_method_is_the_engine_configs_defaults():
    """`cachetune` without a config, with the default config, and its selector: one set of settings."""
    plain, configured = make_method("cachetune"), make_method("cachetune", EngineConfig())
    assert plain.settings == configured.settings
    assert plain.selector.settings is plain.settings
    config = EngineConfig()
    assert (plain.settings.ratio, plain.settings.ranking, plain.settings.allocation, plain.settings.signal,
            plain.settings.deep_within) == (config.ratio, config.ranking, config.allocation, config.signal,
                                            config.deep_within)


def test_every_module_of_the_package_is_imported_and_methods_list_in_a_fixed_order():
    """Importing cachetune.methods imports each of its modules (a new method module needs no list);
    method_names() (and `--methods all`) starts with full recompute, the reference of every other."""
    import pkgutil
    import sys

    import cachetune.methods as package
    for module in pkgutil.iter_modules(package.__path__):
        assert f"cachetune.methods.{module.name}" in sys.modules, module.name
    assert method_names() == ["full_recompute", "prefix", "ape", "cachetune", "full_reuse", "epic", "random", "l2",
                              "highfreq", "lf_only", "cacheblend", "cacheslide", "prophetkv", "keep_every_4th",
                              "block_mean_4", "c2kv", "kvlink", "block_attention"]


def test_a_method_registered_from_outside_the_package_lists_after_its_own():
    from cachetune.methods import METHODS, register
    from cachetune.methods.full_reuse import FullReuseSelector

    register("outside_full_reuse")(lambda settings: SelectiveMethod(FullReuseSelector(), settings))
    try:
        assert method_names()[-1] == "outside_full_reuse"
        assert method_names()[0] == "full_recompute"
        assert make_method("outside_full_reuse").selector.name == "full_reuse"
    finally:
        del METHODS["outside_full_reuse"]


def test_split_global_top_takes_the_best_across_chunks():
    scores = [torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.8, 0.0]), torch.tensor([0.7, 0.3, 0.05, 0.6, 0.5])]
    got = split_global_top(scores, 0.4)  # round(0.4 * 10) = 4 tokens: 0.9, 0.8, 0.7, 0.6
    assert [g.tolist() for g in got] == [[1], [0], [0, 3]]


def test_epic_recomputes_the_first_k_tokens_of_every_chunk_whatever_the_ratio(llama):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(chunks=(40, 10, 50)))
    for ratio in (0.0, 0.5):
        sel = _select("epic", adapter, layout, ratio)
        assert [s.tolist() for s in sel] == [list(range(16)), list(range(10)), list(range(16))]


def _layer_input(model, ids, layer):
    out = model(input_ids=ids[None].to(model.device), output_hidden_states=True)
    return out.hidden_states[layer][0]  # input of decoder layer `layer`


@pytest.mark.parametrize("name,kind", [("cacheblend", "v"), ("cacheslide", "k")])
def test_online_deviation_selection_matches_hf_layer_one(llama, name, kind):
    """CacheBlend picks the largest value deviation at layer 1, CacheSlide the largest key deviation."""
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    hidden = _layer_input(model, layout.input_ids, 1)
    block = model.model.layers[1]
    x = block.input_layernorm(hidden)
    fresh = (block.self_attn.v_proj if kind == "v" else block.self_attn.k_proj)(x)  # [T, Hkv*D], pre-RoPE
    devs = []
    for start, seg in layout.chunk_segments:
        k, v = seg.chunk.load_layer(1, torch.arange(seg.chunk.num_tokens))
        old = (v if kind == "v" else k).flatten(1).to(fresh.device)
        devs.append((fresh[start:start + seg.chunk.num_tokens] - old).pow(2).sum(dim=1))
    expected = split_global_top(devs, 0.15)
    got = _select(name, adapter, layout, 0.15)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]


def test_prophetkv_scores_are_the_questions_attention_averaged_over_layers(llama):
    """With one chunk at position 0, full reuse is exact, so the HF model's own attention is the reference."""
    model, adapter = llama
    layout, scores = _question_attention_reference(model, adapter, adapter.num_layers)
    expected = split_global_top([scores], 0.25)
    got = _select("prophetkv", adapter, layout, 0.25)
    assert got[0].tolist() == expected[0].tolist()


def test_cacheslide_blends_recomputed_kv_with_stored_kv(llama):
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    selector = make_method("cacheslide").selector
    request = _request(adapter, layout)
    sel = selector.select(request, 1.0)
    fuse = selector.fusion(request, sel)
    got = selective_prefill(adapter, layout, sel, layout.total, fuse=fuse)
    plain = selective_prefill(adapter, layout, sel, layout.total)
    # Layers below the first fused one are the plain recompute; later layers mix in stored KV.
    assert_close(plain.cache.keys[:2, :layout.total], got.cache.keys[:2, :layout.total], 1e-6, "unfused layers")
    start, seg = layout.chunk_segments[0]
    k_new = plain.cache.keys[2, start:start + seg.chunk.num_tokens]
    k_got = got.cache.keys[2, start:start + seg.chunk.num_tokens]
    assert not torch.allclose(k_new, k_got)
    # Uncached text (the question) is never blended.
    q = slice(layout.starts[-1], layout.total)
    assert_close(plain.cache.values[2, q], got.cache.values[2, q], 1e-6, "question rows")


def test_lf_only_drops_unselected_tokens_before_a_full_prefill(llama):
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    sel = _select("lf_only", adapter, layout, 0.3)
    got = pruned_prefill(adapter, layout, sel, layout.total)
    kept = iter(sel)
    ids = torch.cat([s.token_ids[next(kept)] if s.cached else s.token_ids for s in layout.segments])
    ref, _ = hf_forward(model, ids)
    assert got.prompt_tokens == ids.numel() < layout.total
    assert_close(ref[-1], got.logits, TOL, "pruned prompt")


# ---- prefix caching ----------------------------------------------------------------------------


def test_prefix_reuses_block_aligned_prefix_losslessly(llama):
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    ids = layout.input_ids
    pc = PrefixCache(block_size=16)
    warm = full_prefill(adapter, PromptLayout([Segment(ids[:45])]), 45)
    pc.insert(ids[:45], warm.cache)
    assert len(pc) == 2 and pc.match(ids) == 32  # full blocks only: 45 -> 32
    got = prefix_prefill(adapter, layout, pc, layout.total + 4)
    ref, _ = hf_forward(model, ids)
    assert got.computed_tokens == layout.total - 32
    assert_close(ref[-1], got.logits, TOL, "prefix hit")
    # Decoding continues from the spliced cache exactly like from a full prefill.
    full = full_prefill(adapter, layout, layout.total + 4)
    assert_close(extend(adapter, full.cache, [5, 6]), extend(adapter, got.cache, [5, 6]), TOL, "decode")


def test_prefix_cache_always_recomputes_the_last_token_and_checks_tokens(monkeypatch):
    pc = PrefixCache(block_size=4)
    ids = torch.arange(8)
    cache = type("C", (), {})()
    cache.keys = torch.randn(2, 8, 1, 2)
    cache.values = torch.randn(2, 8, 1, 2)
    cache.length = 8
    pc.insert(ids, cache)
    assert pc.match(ids) == 4              # a fully cached 8-token prompt still computes its last block
    assert pc.match(torch.arange(9)) == 8
    other = torch.arange(9)
    other[1] = 99
    assert pc.match(other) == 0            # the first block differs: nothing after it may match
    # A hash collision (every block hashes alike) is refused by the token comparison.
    monkeypatch.setattr(prefix_cache, "chained_block_hashes", lambda ids, size, blocks: [b"same"] * blocks)
    colliding = PrefixCache(block_size=4)
    colliding.insert(ids, cache)  # one entry: the second block's key is taken by the first
    assert colliding.match(torch.arange(9)) == 4  # block 2 hits block 1's entry, whose tokens differ
    assert colliding.match(torch.arange(9) + 7) == 0


def test_prefix_cache_evicts_least_recently_used():
    pc = PrefixCache(block_size=2, max_blocks=2)
    cache = type("C", (), {})()
    cache.keys, cache.values, cache.length = torch.zeros(1, 6, 1, 1), torch.zeros(1, 6, 1, 1), 6
    pc.insert(torch.arange(6), cache)
    assert len(pc) == 2 and pc.match(torch.arange(7)) == 0  # the first block was evicted


# ---- APE -------------------------------------------------------------------------------------


def test_ape_attention_without_temperature_or_scale_is_plain_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, generator=g) for n, h in ((3, 4), (10, 2), (10, 2)))
    q_pos = torch.tensor([7, 8, 9])
    key_pos = torch.arange(10)
    ctx = torch.zeros(10, dtype=torch.bool)
    ctx[2:6] = True
    got = ape_attention(q, k, v, q_pos, key_pos, ctx, 0.3, None, APESettings(1.0, 1.0))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    z = torch.einsum("thd,rhd->htr", q, kk) * 0.3
    z = z.masked_fill(key_pos[None, :] > q_pos[:, None], float("-inf"))
    ref = torch.einsum("htr,rhd->thd", torch.softmax(z, -1), vv)
    assert_close(ref, got, 1e-5, "T=S=1")


def test_ape_temperature_and_scale_follow_the_formula():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g)
    ctx = torch.tensor([False, True, True, True, False])
    t, s = 0.5, 0.8
    got = ape_attention(q, k, v, torch.tensor([9]), torch.arange(5), ctx, 1.0, None, APESettings(t, s))
    z = (k[:, 0] @ q[0, 0])
    own, c = z[~ctx], z[ctx]
    mass_own = torch.logsumexp(own, 0)
    mass_ctx = t * torch.logsumexp(c / t, 0) + math.log(s)
    w = torch.softmax(torch.stack([mass_own, mass_ctx]), 0)
    ref = w[0] * torch.softmax(own, 0) @ v[~ctx, 0] + w[1] * torch.softmax(c / t, 0) @ v[ctx, 0]
    assert_close(ref, got[0, 0], 1e-5, "APE merge")


def test_ape_with_one_chunk_and_neutral_settings_equals_full_reuse(llama):
    _, adapter = llama
    layout, _ = build_layout(adapter, [(rand_ids(12, 0), False), (rand_ids(50, 1), True), (rand_ids(9, 2), False)])
    ref = selective_prefill(adapter, layout, none_selected(layout), layout.total + 8)
    got = ape_prefill(adapter, layout, layout.total + 8, APESettings(1.0, 1.0))
    assert_close(ref.logits, got.logits, TOL, "prefill")
    sampling = SamplingConfig(max_new_tokens=6)
    assert generate_tokens(partial(extend, adapter, ref.cache), ref.logits, sampling, set()) == \
        generate_tokens(partial(got.extend, adapter), got.logits, sampling, set())


def test_ape_places_chunks_in_parallel_and_decodes_consistently(llama):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts(prefix=12, chunks=(40, 33, 50), question=9))
    got = ape_prefill(adapter, layout, layout.total + 8)
    starts = [int(got.cache.positions[s]) for s, _ in layout.chunk_segments]
    assert starts == [12, 12, 12]
    assert int(got.cache.positions[layout.total - 1]) == 12 + 50 + 8  # question after the longest chunk
    forced = [5, 9, 11, 3]
    together = got.extend(adapter, forced)
    got.cache.truncate(layout.total)
    one_by_one = torch.cat([got.extend(adapter, [t]) for t in forced])
    assert_close(together, one_by_one, TOL, "extend")


# ---- what a server request may name (methods.base.check_request_method) ------------------------------

def _watch_filesystem(monkeypatch) -> list[str]:
    """Every path the code under test stats or opens from now on (the calls still go through)."""
    import builtins
    import io
    import os
    import pathlib

    seen: list[str] = []

    def watch(owner, name, path_of=lambda args: args[0]):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if args:
                seen.append(str(path_of(args)))
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in [(builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat"),
                        (os.path, "exists"), (os.path, "isfile")]:
        watch(owner, name)
    for name in ("open", "stat", "exists", "is_file", "read_bytes"):
        watch(pathlib.Path, name)
    return seen


def test_a_request_naming_a_weights_file_is_refused_alike_whether_or_not_it_exists(tmp_path, monkeypatch):
    from cachetune.methods import check_request_method

    real = tmp_path / "extractor.safetensors"
    real.write_bytes(b"not weights")
    config = EngineConfig()
    seen = _watch_filesystem(monkeypatch)
    messages = {}
    for path in ["/etc/shadow", "/nonexistent/extractor.safetensors", str(real), str(tmp_path)]:
        for spec in [f"c2kv:{path}", f"c2kv:extractor={path}", f"c2kv:bundled:extractor={path}",
                     f"c2kv:{path}:block=4"]:
            with pytest.raises(ValueError) as caught:
                check_request_method(spec, config)
            messages[spec] = str(caught.value).replace(path, "<path>")
    monkeypatch.undo()
    assert len(set(messages.values())) == 1, messages  # one message: nothing tells which paths exist
    (message,) = set(messages.values())
    assert "<path>" not in message and "'bundled'" in message and "'step0'" in message
    assert "--c2kv-extractor" in message
    assert not any("shadow" in p or "nonexistent" in p or str(tmp_path) in p for p in seen), seen


def test_a_request_may_not_name_other_weights_for_any_trained_method(tmp_path):
    from cachetune.methods import check_request_method

    weights = str(tmp_path / "w.safetensors")
    for spec, setting in [(f"block_attention:{weights}", "weights"), (f"block_attention:weights={weights}", "weights"),
                          (f"kvlink:{weights}", "links"), (f"kvlink:links={weights}:count=5", "links"),
                          ("c2kv:extractor=/x", "extractor"), ("kvlink:bundled2", "links"),
                          ("block_attention:../bundled", "weights")]:
        with pytest.raises(ValueError, match=f"may set {setting} only to one of"):
            check_request_method(spec, EngineConfig())
    for spec, why in [("nope", "unknown method"), ("cachetune:first:allocation=sideways", "unknown allocation"),
                      ("epic:k=four", "not of type int"), ("full_recompute:x", "takes no ':' argument"),
                      ("", "non-empty"), (None, "non-empty"), ("cachetune:" + "x" * 600, "at most"),
                      ("c2kv:block=0", "block must be")]:
        with pytest.raises(ValueError, match=why):
            check_request_method(spec, EngineConfig())


def test_a_request_may_name_registered_methods_shipped_step0_and_configured_weights(tmp_path):
    from cachetune.c2kv.extractor import C2Extractor
    from cachetune.methods import check_request_method

    config = EngineConfig()
    for spec in ["cachetune", "cachetune:first", "cachetune:probe:2", "cachetune:first:allocation=spread",
                 "epic:k=4", "c2kv", "c2kv:bundled", "c2kv:paper", "c2kv:extractor=bundled", "kvlink",
                 "kvlink:step0", "block_attention", "block_attention:step0", "block_attention:weights=bundled",
                 *(f"c2kv:{name}" for name in C2Extractor.STEP0), *method_names()]:
        assert check_request_method(spec, config) is None, spec
    own = {"c2kv_extractor": str(tmp_path / "ex.safetensors"), "kvlink_links": str(tmp_path / "links.safetensors"),
           "block_attention_weights": str(tmp_path / "ba.safetensors")}
    configured = EngineConfig(**own)  # the operator's files (which need not exist to be named)
    for spec in ["c2kv", f"c2kv:{own['c2kv_extractor']}", f"c2kv:extractor={own['c2kv_extractor']}", "c2kv:step0",
                 f"kvlink:{own['kvlink_links']}", f"block_attention:{own['block_attention_weights']}"]:
        check_request_method(spec, configured)
    with pytest.raises(ValueError, match="may set links only"):  # another method's configured file is not its
        check_request_method(f"kvlink:{own['c2kv_extractor']}", configured)
    with pytest.raises(ValueError, match="may set extractor only"):
        check_request_method(f"c2kv:{own['c2kv_extractor']}", config)  # configured elsewhere, not here
    by_method = EngineConfig(method=f"c2kv:{own['c2kv_extractor']}")  # a file in the default method counts too
    check_request_method(f"c2kv:{own['c2kv_extractor']}", by_method)
    check_request_method("cachetune", EngineConfig(method="nope"))  # a bad default is the engine's to refuse
    # Library callers are not restricted: make_method still takes a file (it opens nothing until served).
    assert make_method("c2kv:/some/file.safetensors").settings.extractor == "/some/file.safetensors"


def test_a_huge_probe_count_fails_before_allocating():
    import tracemalloc

    tracemalloc.start()
    try:
        for spec in ["cachetune:probe:10000000", "cachetune:first+probe:10000000", "cachetune:probe:4"]:
            with pytest.raises(ValueError, match="probe count"):
                make_method(spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # nothing was sized by the number


def test_numbers_in_a_method_name_are_bounded_before_they_size_anything():
    for spec, why in [("epic:k=" + "9" * 5000, "not of type int"), ("epic:k=" + "9" * 19, "not of type int"),
                      ("epic:k=1_0", "not of type int"), ("epic:k= 10", "not of type int"),
                      ("epic:k=10000000", "k must be an integer in"),
                      ("keep_every_4th:block=10000000", "block must be"), ("c2kv:block=10000000", "block must be"),
                      ("kvlink:count=100000", "count must be"), ("cacheblend:check_layer=100000", "check_layer must be"),
                      ("cacheslide:check_layer=100000", "check_layer must be"),
                      ("cachetune:signal_layers=100000", "signal_layers must be"),
                      ("cachetune:signal=question:allocation=spread:signal_tokens=10000000", "signal_tokens must be"),
                      ("ape:temperature=nan", "APE temperature"),
                      ("cachetune:" + "+".join(["first"] * 10000), "fuses at most")]:
        with pytest.raises(ValueError, match=why):
            make_method(spec)
    assert make_method("epic:k=1024").settings.k == 1024  # real settings still pass
    assert make_method("cachetune:signal_layers=99").settings.signal_layers == 99
