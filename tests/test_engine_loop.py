"""The step loop as users drive it: concurrent requests, streaming, abort, the KV budget, bad input.

Tiny random Llama with a word-level tokenizer; every comparison is against the same request served
alone (greedy tokens) or the model's own forward."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from cachetune import RequestError, RequestStatus, SamplingConfig
from cachetune.chunks.encode import chunk_id
from cachetune.methods import method_names
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.runtime.decode import extend
from cachetune.runtime.forward import decode_step
from conftest import assert_close, build_layout, none_selected, rand_ids, tiny_engine, words

# Nine requests: mixed methods, chunk sets, orders, question and answer lengths; the last takes deep
# focus (its predicted price, about 0.4 here, is within deep_within=1).
MIXED = [
    ("cachetune", [0, 1, 2], 6, 7),
    ("full_recompute", [2, 0], 9, 5),
    ("epic", [1, 3], 4, 9),
    ("ape", [3, 1, 0], 5, 6),
    ("cacheblend", [0], 8, 4),
    ("full_reuse", [2, 3, 1, 0], 3, 8),
    ("prophetkv", [1, 2], 7, 3),
    ("prefix", [0, 1], 6, 10),
    ("cachetune:deep_within=1", [2, 1, 3], 5, 6),
]
DOC_SIZES = (40, 23, 61, 17)


@pytest.fixture()
def engine():
    return tiny_engine(threads=None)


def _docs(engine):
    return [engine.cache_chunk(words(n, 10 + i)) for i, n in enumerate(DOC_SIZES)]


def _alone(engine, ids, spec):
    method, docs, qlen, new = spec
    out = engine.generate([ids[d] for d in docs], words(qlen, 50 + qlen), method=method,
                          sampling=SamplingConfig(max_new_tokens=new, ignore_eos=True))
    return out.token_ids


def test_nine_concurrent_requests_give_exactly_the_tokens_each_gives_alone(engine):
    ids = _docs(engine)
    alone = [_alone(engine, ids, spec) for spec in MIXED]
    streamed: dict[int, list[int]] = {}
    requests = []
    for method, docs, qlen, new in MIXED:
        requests.append(engine.add_request(
            [ids[d] for d in docs], words(qlen, 50 + qlen), method=method,
            sampling=SamplingConfig(max_new_tokens=new, ignore_eos=True),
            on_token=lambda req, tok: streamed.setdefault(req.id, []).append(tok)))
    batch_sizes = []
    while engine.has_unfinished():
        batch_sizes.append(engine.step().decoded)
    assert max(batch_sizes) == len(MIXED)  # they really decoded together
    for req, expected, spec in zip(requests, alone, MIXED):
        assert req.status is RequestStatus.FINISHED and req.finish_reason == "length"
        assert req.output_ids == expected, spec[0]
        assert streamed[req.id] == expected


def test_batched_decode_of_different_lengths_matches_each_request_alone(tiny_adapter):
    _, adapter = tiny_adapter("llama")
    caches, singles = [], []
    for i, n in enumerate((30, 75, 52)):
        ids = rand_ids(n, 200 + i)
        layout, _ = build_layout(adapter, [(ids, False)])
        caches.append(full_prefill(adapter, layout, n + 4).cache)
        singles.append(full_prefill(adapter, layout, n + 4).cache)
    tokens = [7, 8, 9]
    together = decode_step(adapter, tokens, caches)
    for b, (cache, tok) in enumerate(zip(singles, tokens)):
        alone = decode_step(adapter, [tok], [cache])[0]
        assert_close(alone, together[b], 1e-5, f"request {b}")


def test_decode_step_equals_extend_on_a_reused_cache(tiny_adapter):
    _, adapter = tiny_adapter("llama")
    layout, _ = build_layout(adapter, [(rand_ids(9, 1), False), (rand_ids(40, 2), True), (rand_ids(5, 3), False)])
    a = selective_prefill(adapter, layout, none_selected(layout), layout.total + 4)
    b = selective_prefill(adapter, layout, none_selected(layout), layout.total + 4)
    assert_close(extend(adapter, a.cache, [11])[0], decode_step(adapter, [11], [b.cache])[0], 1e-5, "decode")


def test_abort_mid_decode_frees_its_kv_at_once(engine):
    ids = _docs(engine)
    sampling = SamplingConfig(max_new_tokens=30, ignore_eos=True)
    first = engine.add_request(ids[:2], words(5, 1), sampling=sampling)
    engine.step()  # prefill (first token) and one decode step
    engine.step()
    assert first.status is RequestStatus.RUNNING and len(first.output_ids) == 3
    assert engine.kv_usage().used_rows == first.rows
    engine.abort(first)
    assert engine.kv_usage().used_rows == 0 and engine.kv_usage().running == 0
    assert first.status is RequestStatus.ABORTED and first.finish_reason == "abort"
    engine.step()
    assert len(first.output_ids) == 3  # nothing more decoded for it
    assert not engine.has_unfinished()


def test_a_tiny_kv_budget_queues_requests_and_serves_them_all(engine):
    ids = _docs(engine)
    specs = [MIXED[0], MIXED[2], MIXED[5], MIXED[6]]
    alone = [_alone(engine, ids, spec) for spec in specs]
    rows = [engine.build_prompt([ids[d] for d in docs], words(q, 50 + q)).total + new for _, docs, q, new in specs]
    small = tiny_engine(threads=None, kv_budget_bytes=engine.kv_bytes_per_row * (max(rows) + min(rows) // 2))
    small_ids = _docs(small)
    requests = [small.add_request([small_ids[d] for d in docs], words(q, 50 + q), method=m,
                                  sampling=SamplingConfig(max_new_tokens=new, ignore_eos=True))
                for m, docs, q, new in specs]
    peak = 0
    while small.has_unfinished():
        small.step()
        usage = small.kv_usage()
        assert usage.used_rows <= usage.total_rows
        peak = max(peak, usage.running)
    assert peak == 1  # never two at once: the others waited
    assert [r.output_ids for r in requests] == alone


def test_a_request_larger_than_the_whole_budget_is_rejected_clearly():
    engine = tiny_engine(threads=None, kv_budget_bytes=1)
    cid = engine.cache_chunk(words(20, 3))
    with pytest.raises(RequestError, match="KV budget"):
        engine.add_request([cid], words(4, 4))
    assert engine.kv_usage().waiting == 0 and not engine.has_unfinished()


def test_prompts_and_chunks_beyond_the_context_window_are_rejected_before_any_work(engine):
    limit = engine.max_context
    with pytest.raises(RequestError, match="context window"):
        engine.cache_chunk(words(limit + 1, 5))
    cid = engine.cache_chunk(words(limit - 20, 6))
    with pytest.raises(RequestError, match="context window"):
        engine.add_request([cid], words(5, 7), sampling=SamplingConfig(max_new_tokens=30))
    with pytest.raises(RequestError, match="context window"):
        engine.prefill(engine.build_prompt([cid, cid], words(3, 8)))
    assert not engine.has_unfinished()


def test_failed_chunk_caching_leaves_nothing_behind(engine):
    before = len(engine.store)
    bad = [torch.tensor([5, 10_000]), torch.tensor([1.0, 2.0]), torch.tensor([[5, 6]]), torch.tensor([], dtype=torch.long),
           [5, 6.5], "w5 w6"]
    for ids in bad:
        with pytest.raises((ValueError, TypeError)):
            engine.cache_tokens(ids)
    with pytest.raises(ValueError, match="empty"):
        engine.cache_chunk("")
    assert len(engine.store) == before
    with pytest.raises(KeyError):
        engine.chunk(chunk_id(engine.fingerprint, torch.tensor([5, 10_000])))


def test_method_none_is_the_configured_default_and_unknown_names_list_the_registry(engine):
    cid = engine.cache_chunk(words(30, 9))
    sampling = SamplingConfig(max_new_tokens=3, ignore_eos=True)
    default = engine.generate([cid], words(4, 2), method=None, sampling=sampling)
    named = engine.generate([cid], words(4, 2), method=engine.config.method, sampling=sampling)
    assert default.token_ids == named.token_ids and default.method == engine.config.method
    with pytest.raises(ValueError, match="known: full_recompute, prefix, ape"):
        engine.add_request([cid], "w1", method="nope")
    with pytest.raises(ValueError, match="has no setting 'ranking'"):
        engine.add_request([cid], "w1", method="epic", ranking="first")


@pytest.mark.parametrize("bad", [{"temperature": math.nan}, {"top_p": math.inf}, {"max_new_tokens": 2.5},
                                 {"temperature": -1.0}, {"seed": 1.5}])
def test_sampling_rejects_non_finite_and_mistyped_values(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


# Trained methods have no bundled weights for the tiny models: they serve with their step-0 ones.
TRAINED = {"c2kv", "kvlink", "block_attention"}


@pytest.mark.parametrize("method", method_names())
def test_every_registered_method_serves_through_the_step_loop(engine, method):
    ids = _docs(engine)
    spec = f"{method}:step0" if method in TRAINED else method
    out = engine.generate(ids[:2], words(5, 11), method=spec, sampling=SamplingConfig(max_new_tokens=3))
    assert out.method == spec and out.prompt_tokens == engine.build_prompt(ids[:2], words(5, 11)).total
    assert 0 <= out.recomputed_tokens <= sum(DOC_SIZES[:2])


@pytest.mark.parametrize("method", method_names())
def test_every_registered_method_serves_a_prompt_without_cached_chunks_as_full_prefill(engine, method):
    spec = f"{method}:step0" if method in TRAINED else method
    sampling = SamplingConfig(max_new_tokens=3)
    out = engine.generate([], words(5, 11), method=spec, sampling=sampling)
    assert out.token_ids == engine.generate([], words(5, 11), method="full_recompute", sampling=sampling).token_ids
    assert out.recomputed_tokens == 0


def test_threads_calling_generate_at_once_are_served_correctly(engine):
    ids = _docs(engine)
    alone = [_alone(engine, ids, spec) for spec in MIXED[:4]]
    results: list = [None] * 4
    errors: list = []

    def run(i):
        try:
            results[i] = _alone(engine, ids, MIXED[i])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == alone


def test_a_failing_callback_ends_only_its_request(engine):
    ids = _docs(engine)
    sampling = SamplingConfig(max_new_tokens=4, ignore_eos=True)

    def boom(req, tok):
        raise RuntimeError("consumer went away")

    bad = engine.add_request(ids[:1], words(3, 1), sampling=sampling, on_token=boom)
    good = engine.add_request(ids[:1], words(3, 1), sampling=sampling)
    while engine.has_unfinished():
        engine.step()
    assert bad.status is RequestStatus.FAILED and "consumer" in str(bad.error)
    assert good.status is RequestStatus.FINISHED and len(good.output_ids) == 4
    assert engine.kv_usage().used_rows == 0


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch(engine):
    ids = _docs(engine)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate(ids[:2], words(4, 3), sampling=sampling).token_ids
    reqs = [engine.add_request(ids[:2], words(4, 3), sampling=sampling) for _ in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert all(r.output_ids == alone for r in reqs)


@pytest.mark.parametrize("method", ["full_recompute", "cachetune", "ape"])
def test_a_given_prefill_decodes_in_the_loop_exactly_as_teacher_forcing_does(engine, method):
    # Eval teacher-forces the reference answer through Prefill.extend: the loop must produce the
    # tokens that are exactly the argmax of those logits, with the stop rule applied after each token.
    ids = _docs(engine)
    prompt = engine.build_prompt(ids[:3], words(6, 77))
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    ref = engine.prefill(prompt, method, capacity=prompt.total + 13)
    expected = [int(torch.argmax(ref.logits))]
    for _ in range(11):
        expected.append(int(torch.argmax(ref.extend(engine.adapter, [expected[-1]])[-1])))
    prefix_blocks = len(engine.prefix_cache)
    given = engine.prefill(prompt, method, capacity=prompt.total + 13)
    out = engine.generate(method=method, sampling=sampling, prompt=prompt, prefill=given)
    assert out.token_ids == expected and out.finish_reason == "length"
    assert given.cache.length == prompt.total + 11  # the caller's cache holds the answer's rows
    assert len(engine.prefix_cache) == prefix_blocks  # a given prefill's cache stays the caller's
    given.cache.truncate(given.prompt_rows)
    stopped = engine.generate(method=method, sampling=sampling, prompt=prompt, prefill=given,
                              stop=lambda out: len(out) == 4)
    assert stopped.token_ids == expected[:4] and stopped.finish_reason == "stop"
    assert engine.kv_usage().used_rows == 0


def test_a_stop_rule_ends_a_request_after_the_token_it_accepts(engine):
    ids = _docs(engine)
    sampling = SamplingConfig(max_new_tokens=9, ignore_eos=True)
    full = engine.generate(ids[:2], words(5, 3), sampling=sampling).token_ids
    seen = []

    def third(out: list[int]) -> bool:
        seen.append(len(out))
        return len(out) == 3

    out = engine.generate(ids[:2], words(5, 3), sampling=sampling, stop=third)
    assert out.token_ids == full[:3] and out.finish_reason == "stop" and seen == [1, 2, 3]
    broken = engine.add_request(ids[:2], words(5, 3), sampling=sampling, stop=lambda out: 1 / 0)
    while engine.has_unfinished():
        engine.step()
    assert broken.status is RequestStatus.FAILED and isinstance(broken.error, ZeroDivisionError)
