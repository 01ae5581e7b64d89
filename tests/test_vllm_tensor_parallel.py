"""Tensor parallelism inside real vLLM: two CPU ranks, one core each, blend their own heads in step and
give what one rank gives. The model is a tiny random Llama whose heads divide by two (SmolLM2's 9 do
not) with the bundled model's tokenizer; experiments/vllm_tensor_parallel runs the same comparison on
Qwen2.5-Coder-1.5B.

Skipped where vLLM is not installed; CI installs it."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from cachetune import vllm as ct  # noqa: E402
from cachetune.config import parse_tiers  # noqa: E402
from cachetune.store.blob import ModelShape  # noqa: E402
from cachetune.store.tiered import build_store  # noqa: E402
from cachetune.vllm.config import model_fingerprint_of  # noqa: E402

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                 reason="tensor parallel 2 on CUDA needs two GPUs")]

TEXTS = [
    "The Eiffel Tower is in Paris, the capital of France. It was built in 1889 for the World's Fair. ",
    "Mount Everest is the highest mountain on Earth, on the border of Nepal and China. ",
    "The Amazon river flows through Brazil and is the largest river by discharge volume. ",
    "The Great Wall of China is a series of fortifications built across northern China. ",
]
ORDERS = [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1), (1, 0, 3, 2)]  # five prompts
LOGPROBS = 10
TOKENS = 8


def _serve(model: Path, tier: Path, tensor_parallel: int, work):
    """Start vLLM with the connector over `tier` on `tensor_parallel` ranks, run work(llm, tier), stop."""
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tensor_parallel == 2 else "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    saved = {name: os.environ.get(name) for name in bind}
    os.environ.update(bind)
    llm = None
    try:
        llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=1024,
                       kv_cache_memory_bytes=1 << 27, max_logprobs=LOGPROBS, tensor_parallel_size=tensor_parallel,
                       **ct.llm_options(tiers=f"disk:{tier}:256MiB", ratio=0.3))
        ct.attach(llm)
        return work(llm, tier)
    finally:
        del llm
        gc.collect()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(documents, five prompts of them in different orders)."""
    docs = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    before = tokenizer.encode("Answer from the documents.\n", add_special_tokens=False)
    after = tokenizer.encode("\nQuestion: which of these is the tallest?\nAnswer:", add_special_tokens=False)
    return docs, [before + [t for i in order for t in docs[i]] + after for order in ORDERS]


def _run(llm, tier: Path) -> dict:
    tokenizer = llm.get_tokenizer()
    docs, prompts = _prompts(tokenizer)
    ids = ct.register_documents(llm, docs)
    params = vllm.SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=LOGPROBS)
    found = {"ids": ids}
    for method, ratio in (("cachetune", None), ("cacheblend", None), ("cachetune", 1.0)):
        outputs = llm.generate([ct.blend_prompt(p, method) for p in prompts],
                               ct.sampling(params, ids, method, ratio), use_tqdm=False)
        found[(method, ratio)] = [(list(o.outputs[0].token_ids),
                                   {t: e.logprob for t, e in o.outputs[0].logprobs[0].items()}) for o in outputs]
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    found["plain"] = [list(o.outputs[0].token_ids) for o in plain]
    found["counters"] = llm.collective_rpc("cachetune_counters")
    # A document lost from the tier after it was registered: every rank hands the span back to vLLM.
    lost = tokenizer.encode("The lighthouse of Alexandria stood on the island of Pharos. ", add_special_tokens=False)
    [cid] = ct.register_documents(llm, [lost])
    for path in [p for p in tier.rglob("*") if p.is_file() and cid in p.name]:
        path.unlink()
    prompt = prompts[0][:5] + lost + prompts[0][-8:]
    [blended] = llm.generate([ct.blend_prompt(prompt)], ct.sampling(params, [cid]), use_tqdm=False)
    [plain] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    found["lost"] = (list(blended.outputs[0].token_ids), list(plain.outputs[0].token_ids))
    found["lost_counters"] = llm.collective_rpc("cachetune_counters")
    return found


@pytest.fixture(scope="module")
def runs(tiny_vllm_model, tmp_path_factory):
    tiers = {tp: tmp_path_factory.mktemp(f"tier-tp{tp}") for tp in (1, 2)}
    return {tp: _serve(tiny_vllm_model, tiers[tp], tp, _run) for tp in (2, 1)}, tiers


def test_two_ranks_blend_every_prompt_and_agree_on_what_they_did(runs):
    results, _ = runs
    ranks = results[2]["counters"]
    assert len(ranks) == 2
    blends = 3 * len(ORDERS)
    for counters in ranks:
        assert counters["blended_requests"] == blends and counters["recomputed_by_vllm"] == 0
        assert counters["saved_documents"] == len(TEXTS)
    # The same tokens were recomputed and reused on both ranks: they selected the same ones.
    for name in ("computed_tokens", "recomputed_document_tokens", "reused_tokens"):
        assert ranks[0][name] == ranks[1][name] > 0


def test_tensor_parallel_blends_give_the_single_ranks_tokens(runs):
    results, _ = runs
    for key in (("cachetune", None), ("cacheblend", None), ("cachetune", 1.0)):
        for (two, first_two), (one, first_one) in zip(results[2][key], results[1][key]):
            assert two == one, key
            shared = set(first_two) & set(first_one)
            assert len(shared) >= LOGPROBS // 2
            assert max(abs(first_two[t] - first_one[t]) for t in shared) < 1e-3


def test_full_recompute_on_two_ranks_is_vllms_own_prefill(runs):
    results, _ = runs
    assert [tokens for tokens, _ in results[2][("cachetune", 1.0)]] == results[2]["plain"]


def test_documents_stored_by_two_ranks_hold_every_head_as_one_rank_stores_them(runs, tiny_vllm_model):
    results, tiers = runs
    assert results[2]["ids"] == results[1]["ids"]
    fingerprint = model_fingerprint_of(tiny_vllm_model)
    shape = ModelShape(4, 2, 64)
    stores = {tp: build_store(parse_tiers(f"disk:{tiers[tp]}:256MiB"), fingerprint, shape, torch.device("cpu"),
                              tiers[tp]) for tp in (1, 2)}
    for cid in results[1]["ids"]:
        two, one = stores[2].get(cid), stores[1].get(cid)
        assert torch.allclose(two.scores, one.scores, atol=1e-4)
        rows = torch.arange(one.num_tokens)
        for layer in range(4):
            k2, v2 = two.load_layer(layer, rows)
            k1, v1 = one.load_layer(layer, rows)
            assert k2.shape == k1.shape == (one.num_tokens, 2, 64)
            assert torch.allclose(k2, k1, atol=1e-4) and torch.allclose(v2, v1, atol=1e-4)


def test_a_document_lost_from_the_tier_is_computed_by_vllm_on_every_rank(runs):
    results, _ = runs
    blended, plain = results[2]["lost"]
    assert blended == plain
    assert [c["recomputed_by_vllm"] for c in results[2]["lost_counters"]] == [1, 1]
    assert [c["blended_requests"] for c in results[2]["lost_counters"]] == [3 * len(ORDERS)] * 2
