"""Offline rankers (cachetune.chunks.rankers): each checked against a by-hand or HF reference."""

from __future__ import annotations

import pytest
import torch

from cachetune.chunks.encode import encode_chunk
from cachetune.chunks.kv import encode_kv
from cachetune.chunks.probes import PROBE_PASSAGES, ProbeBank
from cachetune.chunks.rankers import ChunkView, ProbeRanker, RankingContext, get_ranker, rank_tokens
from cachetune.chunks.ranking import kv_drift, lf_scores, rank_fusion, ranking_from_scores, top_share
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.config import EngineConfig
from cachetune.methods import SelectionRequest, is_method, make_method
from cachetune.methods.selector import split_global_top
from cachetune.store.memory import MemoryStore
from conftest import FINGERPRINT, _capture_pre_rope, assert_close, rand_ids


@pytest.fixture(scope="module")
def llama(tiny_adapter):
    return tiny_adapter("llama")


def _context(adapter, bos=None):
    head = rand_ids(7, 70)
    passages = [torch.cat([head, rand_ids(30 + 5 * i, 71 + i)]) for i in range(3)]
    return RankingContext(adapter, ProbeBank(adapter, [head, *passages]), bos)


def _view(adapter, ids, context=None):
    k, v = encode_kv(adapter, ids)
    return ChunkView(ids, k, v, context)


def _hf_kv(model, ids, layers):
    captured = _capture_pre_rope(model, ids)
    return (torch.stack([captured[("k", i)][0] for i in range(layers)]),
            torch.stack([captured[("v", i)][0] for i in range(layers)]))


def test_encoding_after_a_prefix_equals_the_chunk_rows_of_one_plain_forward(llama):
    model, adapter = llama
    ctx = _context(adapter)
    chunk = rand_ids(41, 1)
    probe = ctx.probes.probe(2)
    k, v = ctx.probes.after(2, chunk)
    ref_k, ref_v = _hf_kv(model, torch.cat([probe.token_ids, chunk]), adapter.num_layers)
    p = probe.token_ids.numel()
    assert_close(ref_k[:, p:], k.flatten(2), what="keys after the probe")
    assert_close(ref_v[:, p:], v.flatten(2), what="values after the probe")
    alone_k, _ = _hf_kv(model, chunk, adapter.num_layers)
    assert (alone_k[1:] - k[1:].flatten(2)).abs().max() > 1e-3  # the probe really changes the chunk's K/V


def test_probe_scores_are_the_drift_from_alone_to_after_the_probe_averaged_over_probes(llama):
    _, adapter = llama
    ctx = _context(adapter)
    chunk = rand_ids(50, 2)
    view = _view(adapter, chunk, ctx)
    drifts = [kv_drift(view.keys, view.values, *ctx.probes.after(i, chunk)) for i in (1, 2)]
    assert_close(drifts[0], get_ranker("probe").scores(view))
    assert_close((drifts[0] + drifts[1]) / 2, get_ranker("probe:2").scores(view))
    head = kv_drift(view.keys, view.values, *ctx.probes.after(0, chunk))
    assert_close(head, get_ranker("probe_head").scores(view))
    get_ranker("probe:3").scores(view)  # the bank holds the head and three passages
    with pytest.raises(ValueError, match="needs 5 probes"):  # a bank with fewer probes than a ranker reads
        ProbeRanker("probe:4", [1, 2, 3, 4]).scores(view)
    with pytest.raises(ValueError, match="RankingContext"):
        get_ranker("probe").scores(_view(adapter, chunk))


def test_lf_v0_reads_layer0_values_alone_sees_a_bos_row_and_budgets_globally(llama):
    """The prototype's reading: only layer 0's values count (keys and deeper layers may change freely),
    a BOS row in front of the chunk changes the scores, and its scores compare across chunks."""
    _, adapter = llama
    ids = rand_ids(33, 4)
    view = _view(adapter, ids, _context(adapter, bos=1))
    ranker = get_ranker("lf_v0")
    scores = ranker.scores(view)
    assert scores.shape == (33,) and ranker.global_budget
    keys, values = torch.randn_like(view.keys), view.values.clone()
    values[1:] = torch.randn_like(values[1:])
    assert_close(scores, ranker.scores(ChunkView(ids, keys, values, view.context)))
    values[0] = torch.randn_like(values[0])
    assert not torch.allclose(scores, ranker.scores(ChunkView(ids, keys, values, view.context)))
    assert not torch.allclose(scores, ranker.scores(_view(adapter, ids, _context(adapter, bos=None))))


def test_fusion_ranks_a_token_both_parts_prefer_above_and_keeps_a_single_parts_order(llama):
    _, adapter = llama
    view = _view(adapter, rand_ids(25, 5), _context(adapter))
    first = get_ranker("first").scores(view)
    probe = get_ranker("probe").scores(view)
    fused = get_ranker("first+probe").scores(view)
    for i in range(25):  # a token ranked above another by both parts is fused above it
        for j in range(25):
            if first[i] > first[j] and probe[i] > probe[j]:
                assert fused[i] > fused[j], (i, j)
    assert not torch.equal(ranking_from_scores(fused), ranking_from_scores(first))  # the probe moved it
    assert torch.equal(ranking_from_scores(rank_fusion([probe])), ranking_from_scores(probe))
    assert get_ranker("first+probe").name == "first+probe" and get_ranker("first+probe").needs_model
    with pytest.raises(ValueError, match="globally budgeted"):
        get_ranker("lf_v0+probe")


def test_ranker_names_parse_and_unknown_ones_fail_clearly():
    assert get_ranker("lf").name == "lf" and get_ranker("lf:0.5").name == "lf"
    assert get_ranker("lf", alpha=0.3).name == "lf:0.3"  # a non-default cutoff is another ranking
    assert get_ranker("first_k").name == "first"
    for bad, msg in [("nope", "unknown ranker"), ("probe:0", "probe count"), ("lf:2", "alpha"),
                     ("probe:x", "bad ranker")]:
        with pytest.raises(ValueError, match=msg):
            get_ranker(bad)


def test_ranker_names_are_checked_before_they_size_anything():
    """A probe count past the probe passages (the context holds the head plus one prefix per passage)
    or a hybrid of very many parts fails at once, with nothing allocated for it."""
    import tracemalloc

    assert get_ranker(f"probe:{len(PROBE_PASSAGES)}").probes == list(range(1, len(PROBE_PASSAGES) + 1))
    tracemalloc.start()
    try:
        for bad, msg in [("probe:10000000", "probe count must be an integer in"),
                         (f"probe:{len(PROBE_PASSAGES) + 1}", "probe count"), ("probe:" + "9" * 5000, "probe count"),
                         ("probe:1_0", "probe count"), ("probe: 2", "probe count"), ("first+probe:10000000", "probe count"),
                         ("+".join(["first"] * 100_000), "fuses at most"), ("lf:" + "x" * 5000, "alpha")]:
            with pytest.raises(ValueError, match=msg) as caught:
                get_ranker(bad)
            assert len(str(caught.value)) < 400  # a long name is not echoed back whole
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # nothing was sized by the number


def test_kv_only_rankers_agree_with_their_functions(llama):
    _, adapter = llama
    view = _view(adapter, rand_ids(40, 6))
    assert torch.equal(rank_tokens("lf", view.keys, view.values, view.token_ids).cpu(),
                       ranking_from_scores(lf_scores(view.keys, view.values)).cpu())
    assert torch.equal(rank_tokens("first", view.keys, view.values, view.token_ids).cpu(), torch.arange(40))


def test_encode_chunk_stores_the_given_rankers_scores_and_name(llama):
    _, adapter = llama
    ctx = _context(adapter)
    ids = rand_ids(45, 7)
    enc = encode_chunk(adapter, ids, FINGERPRINT, get_ranker("probe"), ctx)
    expected = get_ranker("probe").scores(_view(adapter, ids, ctx))
    assert enc.ranker == "probe"
    assert_close(expected, enc.scores)
    assert torch.equal(enc.ranking, ranking_from_scores(enc.scores))
    default = encode_chunk(adapter, ids, FINGERPRINT)
    assert default.ranker == "lf" and torch.equal(default.ranking, ranking_from_scores(lf_scores(enc.keys, enc.values)))
    assert torch.equal(default.keys, enc.keys)  # the ranking never changes the stored K/V


class _Source:
    """A RankingSource over stored chunks with a configurable default ranker."""

    def __init__(self, adapter, default, context=None):
        self.adapter, self.default, self.context = adapter, default, context

    def ranker(self, spec=None):
        return get_ranker(spec or self.default)

    def scores(self, chunk, spec=None):
        every = torch.arange(chunk.num_tokens)
        kv = [chunk.load_layer(i, every) for i in range(self.adapter.num_layers)]
        view = ChunkView(chunk.token_ids, torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]),
                         self.context)
        return self.ranker(spec).scores(view)


def _layout(adapter, sizes=(30, 50, 20)):
    store = MemoryStore()
    segments = [Segment(rand_ids(5, 90))]
    for i, n in enumerate(sizes):
        enc = encode_chunk(adapter, rand_ids(n, 80 + i), FINGERPRINT)
        store.put(enc)
        segments.append(Segment(enc.token_ids, store.get(enc.chunk_id)))
    return PromptLayout([*segments, Segment(rand_ids(4, 91))])


def test_cachetune_method_reads_the_default_or_the_named_ranking(llama):
    _, adapter = llama
    ctx = _context(adapter)
    layout = _layout(adapter)
    request = SelectionRequest(layout, adapter, _Source(adapter, "probe", ctx))
    chunks = request.chunks
    offline = EngineConfig(ranking="probe", allocation="proportional", signal="none")  # the ranking alone
    default = make_method("cachetune", offline).selector.select(request, 0.2)
    named = make_method("cachetune:first", offline).selector.select(request, 0.2)
    probe_expected = [top_share(ranking_from_scores(request.rankings.scores(c, "probe")), 0.2) for c in chunks]
    assert all(torch.equal(a, b) for a, b in zip(default, probe_expected))
    assert all(torch.equal(a, torch.arange(round(0.2 * c.num_tokens))) for a, c in zip(named, chunks))
    assert is_method("cachetune:probe+lf") and not is_method("cachetune:nope")


def test_a_globally_budgeted_ranking_selects_top_r_over_all_chunks(llama):
    _, adapter = llama
    layout = _layout(adapter)
    request = SelectionRequest(layout, adapter, _Source(adapter, "lf_v0", _context(adapter)))
    got = make_method("cachetune:lf_v0:allocation=proportional:signal=none").selector.select(request, 0.2)
    scores = [request.rankings.scores(c, "lf_v0") for c in request.chunks]
    expected = split_global_top(scores, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert sum(g.numel() for g in got) == round(0.2 * 100)
    assert [g.numel() for g in got] != [6, 10, 4]  # not a per-chunk split (scores differ across chunks)
