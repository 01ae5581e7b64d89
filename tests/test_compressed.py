"""The training-free 4x controls beside C2KV: one KV row per block of 4 chunk tokens at the block's last
position, against Hugging Face's forward over a cache built from the same rows."""

from __future__ import annotations

import math

import pytest
import torch

from cachetune.c2kv.extractor import block_ends
from cachetune.methods.compressed import block_prefill
from cachetune.runtime.prefill import selective_prefill
from cachetune.runtime.decode import extend
from conftest import (
    assert_close,
    build_layout,
    hf_cache_from_rows,
    hf_forward,
    hf_layer_kv,
    none_selected,
    rand_ids,
    tiny_engine,
    words,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tiny_adapter):
    return tiny_adapter("llama")


def _parts():
    return [(rand_ids(11, 0), False), (rand_ids(37, 1), True), (rand_ids(20, 2), True), (rand_ids(7, 3), False)]


def test_block_ends_are_the_last_token_of_every_block():
    assert block_ends(9, 4).tolist() == [3, 7, 8]
    assert block_ends(8, 4).tolist() == [3, 7]
    assert block_ends(3, 1).tolist() == [0, 1, 2]


@pytest.mark.parametrize("mean", [False, True])
def test_blocks_of_one_token_are_full_reuse(llama, mean):
    _, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    ref = selective_prefill(adapter, layout, none_selected(layout), layout.total + 4)
    got = block_prefill(adapter, layout, layout.total + 4, block=1, mean=mean)
    assert_close(ref.logits, got.logits, TOL, "prefill")
    assert_close(extend(adapter, ref.cache, [5, 6]), extend(adapter, got.cache, [5, 6]), TOL, "decode")


@torch.no_grad()
def _hf_reference(model, adapter, layout, block: int, mean: bool):
    """HF only: the head alone, then a cache of the head's KV plus each chunk's independent K/V reduced
    per block and rotated at the block's last position, then the question at its full-prompt positions."""
    layers = adapter.num_layers
    head = layout.segments[0].token_ids
    _, head_cache = hf_forward(model, head)
    ks = [[hf_layer_kv(head_cache, i)[0]] for i in range(layers)]
    vs = [[hf_layer_kv(head_cache, i)[1]] for i in range(layers)]
    for start, seg in layout.chunk_segments:
        n = seg.chunk.num_tokens
        ends = block_ends(n, block)
        pos = start + ends
        # The chunk's stored pre-RoPE K/V (encoded alone), reduced per block, rotated with HF's own tables.
        for layer in range(layers):
            k_pre, v = seg.chunk.load_layer(layer, torch.arange(n))
            if mean:
                owner = torch.arange(n) // block
                k_pre = torch.stack([k_pre[owner == b].mean(0) for b in range(ends.numel())])
                v = torch.stack([v[owner == b].mean(0) for b in range(ends.numel())])
            else:
                k_pre, v = k_pre[ends], v[ends]
            cos, sin = model.model.rotary_emb(torch.empty(0), pos[None])
            k = k_pre * cos[0][:, None] + _rotate_half(k_pre) * sin[0][:, None]
            ks[layer].append(k)
            vs[layer].append(v)
    past = hf_cache_from_rows([torch.cat(k) for k in ks], [torch.cat(v) for v in vs])
    question = layout.segments[-1].token_ids
    q_pos = torch.arange(layout.starts[-1], layout.total)
    logits, _ = hf_forward(model, question, q_pos, cache=past)
    return logits[-1]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("mean", [False, True])
def test_four_to_one_rows_match_hf_over_the_same_compressed_cache(llama, mean):
    model, adapter = llama
    layout, _ = build_layout(adapter, _parts())
    got = block_prefill(adapter, layout, layout.total, block=4, mean=mean)
    assert_close(_hf_reference(model, adapter, layout, 4, mean), got.logits, TOL, "question logits")
    # Rows: 11 head + ceil(37/4) + ceil(20/4) + 7 question; the question keeps its full-prompt positions.
    assert got.cache.length == 11 + math.ceil(37 / 4) + 5 + 7
    assert got.cache.positions[got.cache.length - 7: got.cache.length].tolist() == list(range(68, 75))
    assert got.cache.next_position() == layout.total


@pytest.mark.parametrize("method", ["keep_every_4th", "block_mean_4"])
def test_compressed_methods_serve_in_a_batch_like_alone(method):
    from cachetune import SamplingConfig

    engine = tiny_engine(threads=None)
    ids = [engine.cache_chunk(words(n, 60 + n)) for n in (33, 18, 41)]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    alone = [engine.generate(ids[i:], words(4, i), method=method, sampling=sampling).token_ids for i in range(3)]
    reqs = [engine.add_request(ids[i:], words(4, i), method=method, sampling=sampling) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == alone


def test_the_kv_budget_reserves_only_the_compressed_rows():
    from cachetune import SamplingConfig

    engine = tiny_engine(threads=None)
    ids = [engine.cache_chunk(words(n, 70 + n)) for n in (33, 18)]
    sampling = SamplingConfig(max_new_tokens=6, ignore_eos=True)
    prompt = engine.build_prompt(ids, words(4, 1))
    head, question = prompt.segments[0].token_ids.numel(), prompt.segments[-1].token_ids.numel()
    for method, rows in (("keep_every_4th", head + 9 + 5 + question), ("full_reuse", prompt.total)):
        request = engine.add_request(prompt=prompt, method=method, sampling=sampling)
        engine.step()
        assert engine.kv_usage().used_rows == request.rows == rows + 6
        while engine.has_unfinished():
            engine.step()
        assert engine.kv_usage().used_rows == 0
