"""Greedy output of the connector at tensor parallel 2 against 1, on a real model (README.md here).

Each tensor-parallel size starts vLLM with the connector over its own disk tier, registers each
prompt's documents through vLLM, and generates greedily from the prompts with their documents
reversed: blended by the default method and by CacheBlend, and plain (vLLM's own prefill). A size
already in --out is not run again (delete it there to rerun)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

METHODS = ("cachetune", "cacheblend")


def _prompts(tokenizer, data: str, limit: int, documents: int):
    """[(document token ids, prompt token ids)] of the first `limit` examples, the documents reversed."""
    from cachetune.engine.prompt import PromptTemplate
    from cachetune.eval.datasets import load_dataset
    from cachetune.eval.harness import TASK_SYSTEM

    template = PromptTemplate(tokenizer)
    found = []
    for example in load_dataset(data, limit=limit):
        docs = [template.document(text).tolist() for text in example.documents[:documents]]
        before, after = template.segments(TASK_SYSTEM[example.task], example.question)
        found.append((docs, before.tolist() + [t for d in reversed(docs) for t in d] + after.tolist()))
    return found


def run_size(args, tensor_parallel: int) -> dict:
    import vllm

    from cachetune import vllm as ct

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tensor_parallel)) \
        if tensor_parallel > 1 else f"0-{args.threads - 1}"
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    tier = tempfile.mkdtemp(prefix=f"tp{tensor_parallel}-")
    started = time.perf_counter()
    llm = vllm.LLM(model=ct.model_dir(args.model), dtype=args.dtype, enforce_eager=True, max_model_len=8192,
                   kv_cache_memory_bytes=1 << 30, tensor_parallel_size=tensor_parallel,
                   **ct.llm_options(tiers=f"disk:{tier}:4GiB", ratio=args.ratio))
    ct.attach(llm)
    result = {"start_s": time.perf_counter() - started, "prompts": []}
    params = vllm.SamplingParams(max_tokens=args.tokens, temperature=0.0)
    for docs, prompt in tqdm(_prompts(llm.get_tokenizer(), args.data, args.limit, args.documents),
                             desc=f"tensor parallel {tensor_parallel}"):
        ids = ct.register_documents(llm, docs)
        row = {"prompt_tokens": len(prompt)}
        for method in METHODS:
            began = time.perf_counter()
            [out] = llm.generate([ct.blend_prompt(prompt, method)], ct.sampling(params, ids, method), use_tqdm=False)
            row[method] = {"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - began}
        began = time.perf_counter()
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        row["plain"] = {"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - began}
        result["prompts"].append(row)
    result["counters"] = llm.collective_rpc("cachetune_counters")
    del llm
    gc.collect()
    return result


def _same(one: list[int], two: list[int]) -> str:
    """"yes", or where the two greedy outputs part (the first differing token's index)."""
    if one == two:
        return f"yes ({len(one)})"
    at = next((i for i, (a, b) in enumerate(zip(one, two)) if a != b), min(len(one), len(two)))
    return f"**no**, from token {at}"


def table(report: dict) -> str:
    one, two = report["sizes"]["1"], report["sizes"]["2"]
    lines = ["| prompt | tokens | " + " | ".join(f"{m}: TP 2 = TP 1 (tokens)" for m in (*METHODS, "plain")) + " |",
             "|---|---|" + "---|" * (len(METHODS) + 1)]
    for i, (a, b) in enumerate(zip(one["prompts"], two["prompts"])):
        same = [_same(a[m]["tokens"], b[m]["tokens"]) for m in (*METHODS, "plain")]
        lines.append(f"| {i} | {a['prompt_tokens']} | " + " | ".join(same) + " |")
    lines.append("")
    lines.append("| seconds a request (generate) | " + " | ".join((*METHODS, "plain")) + " |")
    lines.append("|---|" + "---|" * (len(METHODS) + 1))
    for size, res in (("TP 1", one), ("TP 2", two)):
        means = [sum(p[m]["seconds"] for p in res["prompts"]) / len(res["prompts"]) for m in (*METHODS, "plain")]
        lines.append(f"| {size} | " + " | ".join(f"{s:.2f}" for s in means) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--data", default="musique")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--documents", type=int, default=3, help="documents per prompt (the first ones)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per request")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/vllm/tensor_parallel_qwen.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {"config": vars(args), "sizes": {}}
    for size in (2, 1):
        if str(size) not in report["sizes"]:
            report["sizes"][str(size)] = run_size(args, size)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1))
    text = table(report)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
