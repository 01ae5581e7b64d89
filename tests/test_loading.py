"""The per-layer data path (runtime.loading): one staging buffer per layer, a number of tensor
operations per layer that does not grow with the number of chunks, the same rows from every tier
and every pipeline setting."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cachetune.chunks.encode import encode_chunk
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.loading import SEQUENTIAL, Pipeline, StagingPool
from cachetune.store.disk import DiskStore
from cachetune.store.memory import MemoryStore
from cachetune.store.redis import RedisStore
from conftest import _COMMON, FINGERPRINT, assert_close, rand_ids


TIERS = ["memory", "disk", "redis"]


@functools.lru_cache(maxsize=None)
def llama(layers: int) -> ModelAdapter:
    torch.manual_seed(0)
    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return ModelAdapter(model)


def make_store(kind: str, tmp_path, request):
    if kind == "redis":
        return RedisStore(request.getfixturevalue("redis_server").url, FINGERPRINT, prefix=str(tmp_path))
    return MemoryStore() if kind == "memory" else DiskStore(tmp_path / "chunks", FINGERPRINT)


def chunk_layout(adapter, store, chunks: int, tokens: int):
    segments = [Segment(rand_ids(8, 1))]
    for c in range(chunks):
        encoded = encode_chunk(adapter, rand_ids(tokens, 100 + c), FINGERPRINT)
        store.put(encoded)
        segments.append(Segment(encoded.token_ids, store.get(encoded.chunk_id)))
    segments.append(Segment(rand_ids(40, 2)))
    return PromptLayout(segments)


def select(layout, how: str, share: float):
    """Per chunk: its top `share` by the stored ranking (the reused rows are one rank range), or its
    first tokens (EPIC; not a rank range, so the loader gathers)."""
    chosen = []
    for _, seg in layout.chunk_segments:
        k = round(share * seg.chunk.num_tokens)
        chosen.append(seg.chunk.ranking[:k].sort().values if how == "ranked" else torch.arange(k))
    return chosen


def operator_calls(adapter, layout, selections) -> int:
    """aten operator calls of one selective prefill (loading on the calling thread, so all are seen)."""
    pipeline = Pipeline(overlap=False)
    selective_prefill(adapter, layout, selections, layout.total, pipeline)  # warm the staging pool
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        selective_prefill(adapter, layout, selections, layout.total, pipeline)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("how", ["ranked", "first"])
def test_operator_calls_per_layer_do_not_grow_with_the_number_of_chunks(tier, how, tmp_path, request) -> None:
    per_layer = {}
    for chunks, tokens in ((2, 100), (20, 10)):  # the same tokens in all, so attention does the same work
        calls = []
        for layers in (2, 4):
            adapter = llama(layers)
            store = make_store(tier, tmp_path / f"{chunks}-{layers}", request)
            layout = chunk_layout(adapter, store, chunks, tokens)
            calls.append(operator_calls(adapter, layout, select(layout, how, 0.2)))
        per_layer[chunks] = (calls[1] - calls[0]) / 2
    assert per_layer[2] == per_layer[20], per_layer


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("pipeline", [Pipeline(), SEQUENTIAL, Pipeline(sparse=False), Pipeline(deferred_rope=False),
                                      Pipeline(overlap=False)], ids=str)
@pytest.mark.parametrize("how", ["ranked", "first"])
def test_every_pipeline_and_tier_gives_the_same_cache(tier, pipeline, how, tmp_path, request) -> None:
    adapter = llama(3)
    layout = chunk_layout(adapter, MemoryStore(), 4, 30)
    selections = select(layout, how, 0.3)
    want = selective_prefill(adapter, layout, selections, layout.total, SEQUENTIAL)
    store = make_store(tier, tmp_path, request)
    moved = chunk_layout(adapter, store, 4, 30)
    got = selective_prefill(adapter, moved, selections, layout.total, pipeline)
    assert torch.equal(got.cache.keys[:, :layout.total], want.cache.keys[:, :layout.total])
    assert torch.equal(got.cache.values[:, :layout.total], want.cache.values[:, :layout.total])
    assert torch.equal(got.logits, want.logits)


def test_full_recompute_through_the_loader_is_the_full_prefill(tmp_path) -> None:
    adapter = llama(3)
    layout = chunk_layout(adapter, DiskStore(tmp_path, FINGERPRINT), 3, 25)
    every = [torch.arange(seg.chunk.num_tokens) for _, seg in layout.chunk_segments]
    got = selective_prefill(adapter, layout, every, layout.total)
    assert_close(full_prefill(adapter, layout, layout.total).logits, got.logits, tol=1e-4)


def test_a_request_of_chunks_from_two_tiers_is_read_from_both(tmp_path) -> None:
    adapter = llama(3)
    layout = chunk_layout(adapter, MemoryStore(), 4, 30)
    disk, memory = DiskStore(tmp_path, FINGERPRINT), MemoryStore()
    segments = []
    for i, seg in enumerate(layout.segments):
        if seg.cached:
            tier = disk if i % 2 else memory
            tier.put(seg.chunk.encoded())
            seg = Segment(seg.token_ids, tier.get(seg.chunk.chunk_id))
        segments.append(seg)
    mixed = PromptLayout(segments)
    selections = select(layout, "ranked", 0.2)
    want = selective_prefill(adapter, layout, selections, layout.total)
    got = selective_prefill(adapter, mixed, selections, layout.total)
    assert torch.equal(got.logits, want.logits)


def test_the_staging_pool_hands_a_returned_buffer_out_again() -> None:
    pool = StagingPool()
    first = pool.take(1000, torch.device("cpu"))
    assert first.numel() >= 1000
    other = pool.take(1000, torch.device("cpu"))  # the first is still out
    assert other.data_ptr() != first.data_ptr()
    pool.give(first)
    again = pool.take(800, torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr()
