"""`cachetune bench-vllm`: vLLM's own prefill against vLLM with the connector and the standalone engine,
in one sitting, on the same prompts with the documents in a new order.

Rows (the schema `cachetune bench` writes): `vllm` (vLLM's prefill, prefix caching on, documents never
seen in this order), `vllm+<method>` (the connector), and the standalone engine's methods by name.
`kl_to_full` and `top1_agree` compare each row's first-token distribution with vLLM's full prefill.
`decode_tok_s_8` is decode throughput with 8 concurrent requests with documents.

The standalone arms run first, then the engine is freed and vLLM starts, so no arm shares the CPU with
another's idle threads.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

from cachetune.config import EngineConfig

CONCURRENT = 8
STALL_STEPS = 12  # engine steps timed while 4 requests decode and a blended one arrives at the fifth


@dataclass
class VllmBenchConfig:
    methods: tuple[str, ...] = ("full_reuse", "epic", "cacheblend", EngineConfig.method)
    standalone: tuple[str, ...] = (EngineConfig.method,)
    ratio: float = EngineConfig.ratio
    threads: int = 2
    decode_tokens: int = 32
    short_documents: int = 2     # documents per short prompt (2WikiMQA's two: about 1.4K tokens)
    kv_cache_bytes: int = 4 << 30
    enforce_eager: bool = False  # vLLM as users run it: compiled (start-up takes minutes longer)
    extra: dict = field(default_factory=dict)  # engine overrides (threads, dtype)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of two logit vectors [V]."""
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    return float((p.exp() * (p - q)).sum())


def _dense(logprobs: dict, vocab: int) -> torch.Tensor:
    out = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    for token, entry in logprobs.items():
        out[token] = entry.logprob
    return out


def run_bench_vllm(examples, cfg: VllmBenchConfig, short_examples=()) -> dict:
    """`examples` give the TTFT rows and decode on long prompts; `short_examples` (their first
    `cfg.short_documents` documents each) decode on short ones too."""
    from cachetune.engine.engine import Engine
    from cachetune.eval.harness import Variant, prepare
    from cachetune.runtime.decode import SamplingConfig

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cfg.threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    engine = Engine.from_pretrained(threads=cfg.threads, kv_budget_bytes=cfg.kv_cache_bytes,
                                    prefill_tokens_per_step=10**9)
    variants = [Variant(m, m, cfg.ratio) for m in cfg.standalone]
    standalone: dict[str, list] = {m: [] for m in cfg.standalone}
    sets = {"long": examples, "short": [replace(e, documents=e.documents[:cfg.short_documents]) for e in short_examples]}
    prompts: dict[str, list[list[int]]] = {name: [] for name in sets}
    documents: dict[str, list] = {name: [] for name in sets}
    for name, chosen in sets.items():
        for example in tqdm(chosen, desc=f"standalone engine, {name} prompts"):
            req = prepare(engine, example, variants)
            req.chunk_ids = req.chunk_ids[::-1]  # a new order: the documents reversed, as a reranker might
            prompts[name].append(req.prompt().input_ids.tolist())
            documents[name].append([(cid, engine.chunk(cid).token_ids.tolist()) for cid in req.chunk_ids])
            for method in cfg.standalone if name == "long" else ():
                started = req.start(Variant(method, method, cfg.ratio), 0)
                standalone[method].append((started.ttft_ms, started.prefill.logits.float().cpu()))
    sampling = SamplingConfig(max_new_tokens=cfg.decode_tokens)
    decode_standalone = {name: _standalone_decode(engine, prompts[name][:CONCURRENT], documents[name][:CONCURRENT],
                                                  cfg, sampling) for name in sets if prompts[name]}
    del engine
    gc.collect()
    vllm_rows, measured = _vllm_arms(prompts, documents, cfg)

    full_logits = vllm_rows["vllm"]
    reference = [t for t, _ in full_logits]

    def row(name: str, results: list[tuple[float, torch.Tensor]]) -> dict:
        ttft = [t for t, _ in results]
        kls = [_kl(f, r) for (_, f), (_, r) in zip(full_logits, results)]
        agree = [int(torch.argmax(f)) == int(torch.argmax(r)) for (_, f), (_, r) in zip(full_logits, results)]
        return {"method": name, "ttft_ms_median": statistics.median(ttft),
                "speedup_vs_full": statistics.median(reference) / statistics.median(ttft),
                "kl_to_full": statistics.mean(kls), "top1_agree": sum(agree) / len(agree),
                "ttft_ms": ttft, "kl": kls}

    rows = [row(name, results) for name, results in [*vllm_rows.items(), *standalone.items()]]
    default = EngineConfig.method
    for r in rows:
        if r["method"] == "vllm":
            r["same_prompt_again_ms_median"] = measured["same_prompt_again_ms_median"]
        if r["method"] == f"vllm+{default}":
            r.update({_decode_key(name): tok_s for name, tok_s in measured["decode"].items()})
            r.update(measured["stall"])
        if r["method"] == default:
            r.update({_decode_key(name): tok_s for name, tok_s in decode_standalone.items()})
    return {"config": asdict(cfg), "examples": [e.id for e in examples], "short_examples": [e.id for e in short_examples],
            "rows": rows, "prompt_tokens": {name: [len(p) for p in ps] for name, ps in prompts.items()},
            "connector_counters": measured["counters"]}


def _decode_key(prompts: str) -> str:
    return f"decode_tok_s_{CONCURRENT}" + ("" if prompts == "long" else f"_{prompts}")


def _standalone_decode(engine, prompts, documents, cfg: VllmBenchConfig, sampling) -> float:
    """Decode tokens/s of the standalone engine's default with len(prompts) concurrent requests."""
    requests = []
    for prompt, docs in zip(prompts, documents):
        layout = _layout(engine, prompt, docs)
        requests.append(engine.add_request(prompt=layout, sampling=sampling, ratio=cfg.ratio))
    while any(not r.output_ids for r in requests):  # every prefill done, every first token out
        engine.step()
    produced = sum(len(r.output_ids) for r in requests)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    took = time.perf_counter() - start
    return (sum(len(r.output_ids) for r in requests) - produced) / took


def _layout(engine, prompt: list[int], documents: list[tuple[str, list[int]]]):
    """The standalone layout of `prompt` with its documents (found verbatim) as chunks."""
    from cachetune.runtime.layout import PromptLayout, Segment

    ids = torch.tensor(prompt)
    spans = []
    for cid, tokens in documents:
        for at in range(len(prompt) - len(tokens) + 1):
            if prompt[at:at + len(tokens)] == tokens:
                spans.append((at, cid, len(tokens)))
                break
    spans.sort()
    segments, at = [], 0
    for start, cid, n in spans:
        if start > at:
            segments.append(Segment(ids[at:start]))
        segments.append(Segment(ids[start:start + n], engine.chunk(cid)))
        at = start + n
    segments.append(Segment(ids[at:]))
    return PromptLayout(segments)


def _vllm_arms(prompts: dict, documents: dict, cfg: VllmBenchConfig):
    from vllm import LLM, SamplingParams

    from cachetune import vllm as ct

    llm = LLM(model=ct.model_dir(), dtype="float32", enforce_eager=cfg.enforce_eager, max_logprobs=-1,
              kv_cache_memory_bytes=cfg.kv_cache_bytes, max_model_len=8192,
              **ct.llm_options(ratio=cfg.ratio))
    ct.attach(llm)
    rows: dict[str, list[tuple[float, torch.Tensor]]] = {"vllm": []}
    rows.update({f"vllm+{m}": [] for m in cfg.methods})
    vocab = llm.llm_engine.model_config.get_vocab_size()
    repeats: list[float] = []
    # Timed without logprobs (turning ~50K of them into Python objects would be charged to TTFT); the
    # distribution comes from the same request again, whose blocks vLLM's (salted) prefix cache holds.
    first = SamplingParams(max_tokens=1, temperature=0.0)
    distribution = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1)
    for name, docs in documents.items():
        for listed in docs:
            ids = ct.register_documents(llm, [tokens for _, tokens in listed])
            if ids != [cid for cid, _ in listed]:
                raise RuntimeError("vLLM and the standalone engine gave a document different chunk ids")
    for prompt, listed in tqdm(list(zip(prompts["long"], documents["long"])), desc="vLLM"):
        ids = [cid for cid, _ in listed]
        llm.reset_prefix_cache()
        for name in rows:
            method = name.partition("+")[2]
            request = ct.blend_prompt(prompt, method) if method else {"prompt_token_ids": prompt}
            timed, full = ((ct.sampling(p, documents=ids, method=method, ratio=cfg.ratio) if method else p)
                           for p in (first, distribution))
            start = time.perf_counter()
            llm.generate([request], timed, use_tqdm=False)
            took = (time.perf_counter() - start) * 1000
            out = llm.generate([request], full, use_tqdm=False)[0].outputs[0]
            rows[name].append((took, _dense(out.logprobs[0], vocab)))
        start = time.perf_counter()  # the same prompt again: vLLM's own prefix cache serves it
        llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
        repeats.append((time.perf_counter() - start) * 1000)
    decode = {name: _vllm_decode(llm, ps[:CONCURRENT], cfg) for name, ps in prompts.items() if ps}
    stall = _decode_stall(llm, prompts["long"], cfg)
    counters = ct.counters(llm)
    if counters["recomputed_by_vllm"]:
        raise RuntimeError(f"the connector fell back to vLLM's compute: {counters}")
    del llm
    gc.collect()
    return rows, {"decode": decode, "same_prompt_again_ms_median": statistics.median(repeats),
                  "counters": counters, "stall": stall}


def _decode_stall(llm, prompts, cfg: VllmBenchConfig) -> dict:
    """How long running decodes wait while a blend runs: 4 plain requests decode, one blended request
    arrives, and every engine step is timed (the blend runs inside one step, before its forward)."""
    from vllm import SamplingParams

    from cachetune import vllm as ct

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    decode = SamplingParams(max_tokens=STALL_STEPS, min_tokens=STALL_STEPS, temperature=0.0)
    short = [p[-64:] for p in prompts[:4]]  # short plain prompts: their prefill is over in one step
    for i, prompt in enumerate(short):
        engine.add_request(f"stall-plain-{i}", {"prompt_token_ids": prompt}, decode)
    steps = []
    for step in range(STALL_STEPS):
        if step == 4:  # decoding is under way: a blended request arrives
            params = ct.sampling(SamplingParams(max_tokens=2, temperature=0.0), ratio=cfg.ratio)
            engine.add_request("stall-blend", ct.blend_prompt(prompts[-1], EngineConfig.method), params)
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start) * 1000)
    while engine.has_unfinished_requests():
        engine.step()
    return {"decode_step_ms_median": statistics.median(steps[1:4] + steps[6:]), "decode_stall_ms": max(steps[4:6])}


def _vllm_decode(llm, prompts, cfg: VllmBenchConfig) -> float:
    """Decode tokens/s of vLLM with the connector's default and len(prompts) concurrent blended requests,
    timed from the step after the last first token (the blends are prefill, not decode)."""
    from vllm import SamplingParams

    from cachetune import vllm as ct

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    params = ct.sampling(SamplingParams(max_tokens=cfg.decode_tokens, min_tokens=cfg.decode_tokens,
                                        temperature=0.0), ratio=cfg.ratio)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", ct.blend_prompt(prompt, EngineConfig.method), params)
    produced: dict[str, int] = {}
    while len(produced) < len(prompts) or any(n == 0 for n in produced.values()):
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    before = sum(produced.values())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    return (sum(produced.values()) - before) / (time.perf_counter() - start)


def format_vllm_table(report: dict) -> str:
    stall = ""
    lines = ["| method | TTFT median (ms) | speedup vs vLLM prefill | KL to vLLM full | top-1 agree | "
             "decode tok/s, 8 long | decode tok/s, 8 short |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        decode = " | ".join(f"{r[k]:.1f}" if k in r else "" for k in (_decode_key("long"), _decode_key("short")))
        lines.append(f"| {r['method']} | {r['ttft_ms_median']:.0f} | {r['speedup_vs_full']:.2f}x | "
                     f"{r['kl_to_full']:.4f} | {r['top1_agree']:.2f} | {decode} |")
        if "decode_stall_ms" in r:
            stall = (f"\nWhile a blend of {r['method']} runs, running decodes wait: a decode step takes "
                     f"{r['decode_step_ms_median']:.0f} ms, the step with the blend {r['decode_stall_ms']:.0f} ms.")
    return "\n".join(lines) + stall


def plot_vllm(report: dict, path) -> str:
    """Median TTFT per row, one bar each."""
    from cachetune.eval.report import pyplot

    plt = pyplot()
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r["method"] for r in rows], [r["ttft_ms_median"] / 1000 for r in rows], color="tab:blue")
    ax.set_xlabel("time to first token, median (s)")
    ax.invert_yaxis()
    ax.set_title("Reordered documents: vLLM alone, with the connector (vllm+), the standalone engine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
