"""The KV-drift harness (paper appendix E.2) on a tiny random Llama: definitions checked by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cachetune.chunks.encode import encode_chunk
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.eval.datasets import QAExample
from cachetune.eval.drift import (
    DRIFT_DEFINITION,
    DriftConfig,
    context_kv,
    kv_drift,
    layer_drift,
    plot_drift,
    position_profile,
    recall_at,
    run_drift_recall,
    spearman,
)
from cachetune.store.memory import MemoryStore
from conftest import FINGERPRINT, VOCAB, _capture_pre_rope, assert_close, rand_ids


class TinyEngine:
    """The part of cachetune.Engine the harnesses use, on a tiny model with a byte-level 'tokenizer'."""

    name = "tiny-llama"

    def __init__(self, adapter):
        self.adapter = adapter
        self.store = MemoryStore()

    def tokenize(self, text: str) -> torch.Tensor:
        return torch.tensor([3 + b % (VOCAB - 3) for b in text.encode()], dtype=torch.int64)

    def cache_chunk(self, text: str) -> str:
        enc = encode_chunk(self.adapter, self.tokenize(text), FINGERPRINT)
        self.store.put(enc)
        return enc.chunk_id

    def chunk(self, cid: str):
        return self.store.get(cid)

    def build_prompt(self, chunks, question: str) -> PromptLayout:
        stored = [self.chunk(cid) for cid in chunks]
        return PromptLayout([
            Segment(self.tokenize("System: answer.\n")),
            *(Segment(c.token_ids, c) for c in stored),
            Segment(self.tokenize(f"Question: {question}\nAnswer:")),
        ])


def tiny_examples(count: int = 2) -> list[QAExample]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    return [
        QAExample(id=f"tiny-{i}", documents=[" ".join(words[j:] + words[:j]) * 2 for j in range(i, i + 3)],
                  question=f"what is {words[i]}?", answers=[words[i]])
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def llama(tiny_adapter):
    return tiny_adapter("llama")


def _chunk_drift(adapter, layout):
    """Raw per-layer drift [L, N] and kv_drift [N] of the layout's only chunk."""
    ctx_k, ctx_v = context_kv(adapter, layout)
    (start, seg), = layout.chunk_segments
    n = seg.chunk.num_tokens
    idx = torch.arange(n)
    alone = [seg.chunk.load_layer(layer, idx) for layer in range(adapter.num_layers)]
    k = torch.stack([a for a, _ in alone])
    v = torch.stack([b for _, b in alone])
    ck, cv = ctx_k[:, start : start + n].cpu(), ctx_v[:, start : start + n].cpu()  # the store keeps chunks on the CPU
    return layer_drift(k, ck), layer_drift(v, cv), kv_drift(k, v, ck, cv), ck


# ---- context_kv --------------------------------------------------------------------------------


def test_context_kv_equals_hf_pre_rope_kv_of_the_whole_prompt(llama, layout_builder):
    model, adapter = llama
    layout, _ = layout_builder(adapter, [(rand_ids(12, 1), False), (rand_ids(40, 2), True), (rand_ids(8, 3), False)])
    keys, values = context_kv(adapter, layout)
    captured = _capture_pre_rope(model, layout.input_ids)  # HF forward hooks on k_proj / v_proj
    t = layout.total
    assert keys.shape == (adapter.num_layers, t, adapter.num_kv_heads, adapter.head_dim)
    for layer in range(adapter.num_layers):
        assert_close(captured[("k", layer)][0], keys[layer].reshape(t, -1), what=f"keys layer {layer}")
        assert_close(captured[("v", layer)][0], values[layer].reshape(t, -1), what=f"values layer {layer}")


# ---- drift -------------------------------------------------------------------------------------


def test_chunk_at_position_zero_with_nothing_before_it_does_not_drift(llama, layout_builder):
    _, adapter = llama
    layout, _ = layout_builder(adapter, [(rand_ids(60, 4), True), (rand_ids(10, 5), False)])
    dk, dv, drift, ck = _chunk_drift(adapter, layout)
    norm = ck.float().flatten(2).norm(dim=2)
    assert float(dk.max()) <= 1e-5 * float(norm.max())
    assert float(dv.max()) <= 1e-4 * float(norm.max()) + 1e-5
    # Every layer is at the noise floor, so no rounding noise is blown up into a ranking signal.
    assert torch.all(drift == 0)


def test_chunk_after_an_uncached_prefix_drifts_from_layer_one_on(llama, layout_builder):
    _, adapter = llama
    layout, _ = layout_builder(adapter, [(rand_ids(30, 6), False), (rand_ids(60, 4), True), (rand_ids(10, 5), False)])
    dk, dv, drift, ck = _chunk_drift(adapter, layout)
    # Layer 0's K/V are projections of the token embeddings alone: no context can reach them.
    assert float(dk[0].max()) <= 1e-5 * float(ck[0].float().norm())
    norm = ck[1:].float().flatten(2).norm(dim=2)
    assert float(dk[1:].sum()) > 1e-2 * float(norm.sum())
    assert float(dv[1:].sum()) > 0
    assert drift.shape == (60,)
    # Normalised per layer and averaged over layers: live layers each sum to 1, the dead layer 0 to 0.
    assert math.isclose(float(drift.sum()), (adapter.num_layers - 1) / adapter.num_layers, rel_tol=1e-5)


def test_kv_drift_normalises_each_layer_then_weights_k_and_v_equally():
    # 2 layers, 3 tokens, 1 head, 2 dims; alone = 0, so drift = norm of ctx.
    zeros = torch.zeros(2, 3, 1, 2)
    ctx_k = torch.zeros(2, 3, 1, 2)
    ctx_v = torch.zeros(2, 3, 1, 2)
    ctx_k[0, :, 0, 0] = torch.tensor([3.0, 1.0, 0.0])       # layer 0 K: norms 3, 1, 0 -> 0.75, 0.25, 0
    ctx_k[1, :, 0] = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 5.0]])  # norms 0, 5, 5 -> 0, .5, .5
    ctx_v[0, :, 0, 1] = torch.tensor([1.0, 1.0, 2.0])       # -> 0.25, 0.25, 0.5
    ctx_v[1, :, 0, 0] = torch.tensor([10.0, 0.0, 0.0])      # -> 1, 0, 0
    drift = kv_drift(zeros, zeros, ctx_k, ctx_v)
    layer0 = 0.5 * torch.tensor([0.75, 0.25, 0.0]) + 0.5 * torch.tensor([0.25, 0.25, 0.5])
    layer1 = 0.5 * torch.tensor([0.0, 0.5, 0.5]) + 0.5 * torch.tensor([1.0, 0.0, 0.0])
    assert torch.allclose(drift, (layer0 + layer1) / 2)
    # Scaling one layer's difference changes nothing: layers weigh equally whatever their magnitude.
    ctx_k[1] *= 1000
    assert torch.allclose(kv_drift(zeros, zeros, ctx_k, ctx_v), drift)


def test_kv_drift_is_computed_in_float32_from_half_inputs():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 2, 5, 1, 4, generator=g)
    ref = kv_drift(a, a, b, b)
    assert kv_drift(a.bfloat16(), a.bfloat16(), b.bfloat16(), b.bfloat16()).dtype == torch.float32
    assert torch.allclose(kv_drift(a.bfloat16(), a.bfloat16(), b.bfloat16(), b.bfloat16()), ref, atol=2e-2)


# ---- small metrics -----------------------------------------------------------------------------


def test_recall_at_counts_reference_tokens_that_were_selected():
    assert recall_at(torch.tensor([0, 2, 5]), torch.tensor([2, 3, 5, 7])) == 0.5
    assert recall_at(torch.tensor([1]), torch.tensor([1])) == 1.0
    assert recall_at(torch.empty(0, dtype=torch.int64), torch.tensor([4])) == 0.0
    with pytest.raises(ValueError):
        recall_at(torch.tensor([1]), torch.empty(0, dtype=torch.int64))


def test_spearman_and_position_profile_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x * 10 + 1) == pytest.approx(1.0)
    assert spearman(x, -x.exp()) == pytest.approx(-1.0)
    assert math.isnan(spearman(x, torch.ones(4)))
    profile = position_profile(torch.tensor([4.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(profile, torch.tensor([0.8, 0, 0, 0, 0, 0.2, 0, 0, 0, 0]))


def test_drift_config_rejects_unknown_rankers_and_bad_ratios():
    with pytest.raises(ValueError, match="unknown ranker"):
        DriftConfig(rankers=("lf", "nope"))
    with pytest.raises(ValueError, match="ratio"):
        DriftConfig(ratio=0.0)


# ---- the whole run -----------------------------------------------------------------------------


def test_run_drift_recall_reports_recall_per_ranker_and_where_drift_sits(llama, tmp_path):
    _, adapter = llama
    report = run_drift_recall(TinyEngine(adapter), tiny_examples(2), DriftConfig(), progress=False)
    json.dumps(report)  # JSON-ready
    assert report["model"] == "tiny-llama"
    assert report["drift_definition"] == DRIFT_DEFINITION
    assert (report["ratio"], report["alpha"], report["examples"], report["chunks"]) == (0.15, 0.5, 2, 6)
    assert set(report["recall"]) == set(report["recall_by_example"]) == {"lf", "highfreq", "l2", "random", "first"}
    for value in [*report["recall"].values(), *report["recall_by_example"].values(), report["random_expectation"],
                  report["high_drift_in_first15"], *report["drift_share_by_decile"]]:
        assert 0.0 <= value <= 1.0
    assert len(report["drift_share_by_decile"]) == 10
    assert sum(report["drift_share_by_decile"]) == pytest.approx(1.0)
    # With ratio 0.15 the "first" ranker selects exactly the first 15% of each chunk.
    assert report["recall"]["first"] == pytest.approx(report["high_drift_in_first15"])
    assert -1.0 <= report["spearman_lf_drift"] <= 1.0
    assert len(report["relative_drift_by_layer"]["k"]) == adapter.num_layers
    assert report["relative_drift_by_layer"]["k"][0] < 1e-5 < report["relative_drift_by_layer"]["k"][1]
    assert len(report["per_example"]) == 2 and len(report["per_example"][0]["chunks"]) == 3
    plot_drift(report, tmp_path / "drift.png")
    assert (tmp_path / "drift.png").read_bytes()[:4] == b"\x89PNG"


def test_ratio_one_recalls_everything(llama):
    _, adapter = llama
    report = run_drift_recall(TinyEngine(adapter), tiny_examples(1), DriftConfig(ratio=1.0), progress=False)
    assert all(v == 1.0 for v in report["recall"].values())
