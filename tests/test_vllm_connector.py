"""The connector inside real vLLM (the CPU build `make vllm` installs), against vLLM's own prefill and the
standalone engine. One vLLM instance serves every test here (start-up costs about 25 s on 2 cores).

Skipped where vLLM is not installed; CI installs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from cachetune import vllm as ct  # noqa: E402
from cachetune.chunks.encode import encode_chunk  # noqa: E402
from cachetune.engine.engine import Engine  # noqa: E402
from cachetune.methods import PromptLayout, Segment  # noqa: E402

pytestmark = pytest.mark.real_model

TEXTS = [
    "The Eiffel Tower is in Paris, the capital of France. It was built in 1889 for the World's Fair and is 330 "
    "metres tall. ",
    "Mount Everest is the highest mountain on Earth, on the border of Nepal and China. Its summit is 8,849 "
    "metres above sea level. ",
    "The Amazon river flows through Brazil and is the largest river by discharge volume. It rises in the Andes "
    "mountains of Peru. ",
]
LOGPROBS = 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    tier = tmp_path_factory.mktemp("tier")
    llm = vllm.LLM(model=ct.model_dir(), dtype="float32", enforce_eager=True, max_model_len=4096,
                   kv_cache_memory_bytes=1 << 30, max_logprobs=LOGPROBS,
                   **ct.llm_options(tiers=f"disk:{tier}:1GiB", ratio=0.15))
    ct.attach(llm)
    engine = Engine.from_pretrained(tiers=f"disk:{tier}:1GiB", threads=2)
    yield llm, engine, tier
    del llm


def _docs(engine: Engine) -> list[list[int]]:
    return [engine.template.document(text).tolist() for text in TEXTS]


def _prompt(engine: Engine, docs: list[list[int]], question: str = "Where is the Eiffel Tower?") -> list[int]:
    before, after = engine.template.segments("Answer from the documents.", question)
    return before.tolist() + [t for d in docs for t in d] + after.tolist()


def _first(output) -> dict[int, float]:
    return {token: entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}


def _generate(llm, prompt: list[int], method: str | None = None, documents=None, ratio=None, tokens: int = 6):
    params = vllm.SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=LOGPROBS)
    if method is None:
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return llm.generate([ct.blend_prompt(prompt, method)], ct.sampling(params, documents, method, ratio),
                        use_tqdm=False)[0]


def _close(a: dict[int, float], b: dict[int, float], tolerance: float) -> bool:
    shared = set(a) & set(b)
    return len(shared) >= LOGPROBS // 2 and max(abs(a[t] - b[t]) for t in shared) < tolerance


def _standalone_first(engine: Engine, prompt: list[int], docs, ids, method: str, ratio=None) -> dict[int, float]:
    """The standalone engine's first-token logprobs over the same prompt with the same stored documents."""
    ids_t = torch.tensor(prompt)
    segments, at = [], 0
    for doc, cid in zip(docs, ids):
        start = next(i for i in range(at, len(prompt)) if prompt[i:i + len(doc)] == doc)
        if start > at:
            segments.append(Segment(ids_t[at:start]))
        segments.append(Segment(ids_t[start:start + len(doc)], engine.chunk(cid)))
        at = start + len(doc)
    segments.append(Segment(ids_t[at:]))
    logits = engine.prefill(PromptLayout(segments), method, ratio).logits
    logprobs = torch.log_softmax(logits.double(), -1)
    top = torch.topk(logprobs, LOGPROBS)
    return {int(t): float(v) for t, v in zip(top.indices, top.values)}


def test_documents_registered_through_vllm_have_the_standalone_engines_ids_and_kv(served):
    llm, engine, _ = served
    docs = _docs(engine)
    ids = ct.register_documents(llm, docs)
    encoded = engine.chunks_encoded
    assert ids == [engine.cache_tokens(d) for d in docs]
    assert engine.chunks_encoded == encoded  # found in the shared tier, as vLLM stored them: nothing encoded
    # The KV vLLM computed equals the standalone engine's own encoding of the same text.
    mine = encode_chunk(engine.adapter, torch.tensor(docs[0]), engine.fingerprint)
    stored = engine.chunk(ids[0])
    rows = torch.arange(stored.num_tokens)
    for layer in (0, engine.adapter.num_layers - 1):
        keys, values = stored.load_layer(layer, rows)
        assert torch.allclose(keys.float(), mine.keys[layer].float(), atol=2e-3)
        assert torch.allclose(values.float(), mine.values[layer].float(), atol=2e-3)


def test_rows_read_back_from_vllms_paged_cache_are_exactly_what_its_backend_wrote(served):
    llm, _, _ = served
    assert llm.collective_rpc("cachetune_layout_error") == [0.0]


def test_the_blends_attention_runs_on_vllms_kernel_and_equals_the_runtimes(served):
    llm, _, _ = served
    [error] = llm.collective_rpc("cachetune_attention_error")
    if torch.cuda.is_available():  # GPU backends use the runtime's attention (docs/vllm.md, "On a GPU")
        assert error is None
    else:
        assert error is not None and error < 1e-5


def test_full_ratio_inside_vllm_equals_vllms_own_prefill(served):
    llm, engine, _ = served
    docs = _docs(engine)
    ids = ct.register_documents(llm, docs)
    prompt = _prompt(engine, docs[::-1])
    plain = _generate(llm, prompt)
    blended = _generate(llm, prompt, "cachetune", ids, ratio=1.0)
    assert blended.outputs[0].token_ids == plain.outputs[0].token_ids
    assert _close(_first(blended), _first(plain), 1e-3)


@pytest.mark.parametrize("method", ["full_reuse", "cachetune", "epic", "cacheblend"])
def test_a_method_inside_vllm_equals_the_standalone_engine(served, method):
    llm, engine, _ = served
    docs = _docs(engine)
    ids = ct.register_documents(llm, docs)
    prompt = _prompt(engine, docs[::-1], "How tall is Mount Everest?")
    inside = _first(_generate(llm, prompt, method, ids, tokens=1))
    alone = _standalone_first(engine, prompt, docs[::-1], ids[::-1], method, 0.15)
    assert _close(inside, alone, 2e-3)
    full = _first(_generate(llm, prompt, tokens=1))
    if method == "full_reuse":  # the comparison can fail: reuse without recompute is visibly not exact
        assert not _close(inside, full, 1e-2)


def test_a_plain_request_after_a_blended_one_gets_full_prefill(served):
    llm, engine, _ = served
    docs = _docs(engine)
    ids = ct.register_documents(llm, docs)
    prompt = _prompt(engine, [docs[1], docs[2], docs[0]], "Which river is the largest?")
    blended = _generate(llm, prompt, "full_reuse", ids)
    after = _generate(llm, prompt)
    llm.reset_prefix_cache()
    fresh = _generate(llm, prompt)
    assert _close(_first(after), _first(fresh), 1e-4)
    assert not _close(_first(blended), _first(fresh), 1e-2)


def test_an_unsalted_request_with_documents_is_left_to_vllm(served):
    llm, engine, _ = served
    docs = _docs(engine)
    ids = ct.register_documents(llm, docs)
    prompt = _prompt(engine, docs[::-1], "Where does the Amazon rise?")
    before = ct.counters(llm)["blended_requests"]
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=LOGPROBS)
    llm.generate([{"prompt_token_ids": prompt}], ct.sampling(params, ids, "full_reuse"), use_tqdm=False)
    assert ct.counters(llm)["blended_requests"] == before


def test_a_batch_gives_each_request_what_it_gets_alone(served):
    llm, engine, _ = served
    docs = _docs(engine)
    ids = ct.register_documents(llm, docs)
    with_docs = _prompt(engine, [docs[2], docs[0]], "What was built in 1889?")
    without = _prompt(engine, [], "Name a mountain.")
    repeated = _prompt(engine, docs, "How tall is the tower?")
    _generate(llm, repeated)  # vLLM's prefix cache holds it now
    params = vllm.SamplingParams(max_tokens=6, temperature=0.0, logprobs=LOGPROBS)
    requests = [ct.blend_prompt(with_docs, "cachetune"), {"prompt_token_ids": without},
                {"prompt_token_ids": repeated}]
    sampling = [ct.sampling(params, [ids[2], ids[0]], "cachetune"), params, params]
    llm.reset_prefix_cache()
    _generate(llm, repeated)
    batch = llm.generate(requests, sampling, use_tqdm=False)
    llm.reset_prefix_cache()
    _generate(llm, repeated)
    alone = [llm.generate([r], s, use_tqdm=False)[0] for r, s in zip(requests, sampling)]
    for together, single in zip(batch, alone):
        assert together.outputs[0].token_ids == single.outputs[0].token_ids
        assert _close(_first(together), _first(single), 1e-3)


@pytest.mark.parametrize("damage", ["evicted", "corrupt"])
def test_a_lost_document_is_computed_by_vllm_and_counted(served, damage):
    llm, engine, tier = served
    text = f"A document that will be {damage}: the lighthouse of Alexandria stood on the island of Pharos. "
    doc = engine.template.document(text).tolist()
    [cid] = ct.register_documents(llm, [doc])
    files = [p for p in Path(tier).rglob("*") if p.is_file() and cid in p.name]
    assert files
    for path in files:
        if damage == "evicted":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    prompt = _prompt(engine, [doc], "Where did the lighthouse stand?")
    before = ct.counters(llm)
    blended = _generate(llm, prompt, "full_reuse", [cid])
    llm.reset_prefix_cache()
    plain = _generate(llm, prompt)
    after = ct.counters(llm)
    assert after["recomputed_by_vllm"] == before["recomputed_by_vllm"] + 1
    assert blended.outputs[0].token_ids == plain.outputs[0].token_ids
    assert _close(_first(blended), _first(plain), 1e-3)
