"""`cachetune bench-batch`: decode throughput and time to first token with many requests at once.

For each prompt size and each concurrency c, the first c requests of the set are added together and
the engine steps until all have ended: every step admits what fits and prefills it, then decodes one
token for every running request in one batched pass. Each request decodes exactly `max_new_tokens`
(end-of-sequence ignored), so every concurrency level does the same work per request. Before the
batches, every request is served alone once: its greedy tokens are the reference each batch is
checked against, token for token.

Reported per (size, c): decode tokens/s (tokens of the batched decode steps over their time), end-to-end
tokens/s (all generated tokens over the wall time of the batch), the decode speedup over c = 1, TTFT
(add_request to first token, queueing included) median / p95 / max, and whether every request's tokens
equal its tokens alone. `hf_baseline` adds, per concurrency level, Hugging Face's own batched greedy
decode of the same full prompts (left-padded, its growing DynamicCache): tokens/s of the steps after
its first token, stamped from inside its loop. With `repeats` > 1 the levels run that many times,
interleaved (1, 4, 8, 16, 1, 4, ...), so a slow spell of a shared machine does not land on one level
only; rates are medians over the repeats and TTFTs are pooled.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from cachetune.engine.engine import Engine
from cachetune.engine.prompt import QUESTION_LABEL
from cachetune.eval.datasets import QAExample
from cachetune.eval.harness import TASK_SYSTEM
from cachetune.eval.metrics import summarize
from cachetune.eval.report import pyplot, save_figure
from cachetune.methods import PromptLayout
from cachetune.runtime.decode import SamplingConfig


@dataclass
class BatchBenchConfig:
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    max_new_tokens: int = 32
    method: str | None = None  # None: the engine's default method
    ratio: float | None = None  # None: the engine's default ratio
    sizes: dict[str, int] = field(default_factory=dict)  # size name -> documents per prompt (0: all)
    repeats: int = 1  # passes over the concurrency levels, interleaved
    hf_baseline: bool = False  # also time transformers' own batched decode at every level

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be >= 1")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


class _StepClock(StoppingCriteria):
    """Never stops generation; stamps the time after every generated token (prefill + first, then each step)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize(input_ids.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def hf_decode_rate(engine: Engine, prompts: list[PromptLayout], new_tokens: int) -> float:
    """Decode tokens/s of transformers' `generate` on the prompts as one left-padded greedy batch: the
    steps after the first token, timed from inside the loop (so the prefill is not counted)."""
    model, tokenizer = engine.model, engine.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = max(p.total for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - p.total:] = p.input_ids
        mask[i, longest - p.total:] = 1
    clock = _StepClock()
    model.generate(input_ids=ids.to(engine.adapter.device), attention_mask=mask.to(engine.adapter.device),
                   max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False,
                   pad_token_id=pad, stopping_criteria=StoppingCriteriaList([clock]))
    return len(prompts) * new_tokens / (clock.times[-1] - clock.times[0])


def example_prompt(engine: Engine, example: QAExample, documents: int = 0) -> PromptLayout:
    """The prompt of `example` with its first `documents` documents (0: all) cached as chunks."""
    docs = example.documents[:documents] if documents else example.documents
    ids = [engine.cache_document(doc) for doc in docs]
    before, after = engine.template.segments(TASK_SYSTEM[example.task], example.question,
                                             "" if example.verbatim else QUESTION_LABEL)
    return engine.prompt_from(before, ids, after)


def _serve(engine: Engine, prompts: list[PromptLayout], cfg: BatchBenchConfig) -> dict:
    """Add every prompt at once, step until all end; tokens, TTFTs and decode timing."""
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(prompt=p, method=cfg.method, ratio=cfg.ratio, sampling=sampling) for p in prompts]
    decode_s, decoded, batches = 0.0, 0, []
    while engine.has_unfinished():
        step = engine.step()
        if step.decoded:
            decode_s += step.decode_s
            decoded += step.decoded
            batches.append(step.decoded)
    wall = time.perf_counter() - start
    failed = [r for r in requests if r.error is not None]
    if failed:
        raise RuntimeError(f"request {failed[0].id} failed: {failed[0].error}")
    return {
        "tokens": [list(r.output_ids) for r in requests],
        "ttft_ms": [r.ttft_ms for r in requests],
        "decode_s": decode_s,
        "decode_tokens": decoded,
        "mean_batch": statistics.fmean(batches) if batches else 0.0,
        "wall_s": wall,
        "generated": sum(len(r.output_ids) for r in requests),
    }


def run_bench_batch(engine: Engine, sets: dict[str, list[QAExample]], cfg: BatchBenchConfig,
                    progress: bool = True) -> dict:
    """sets: size name -> examples (at least max(concurrency) of them). Returns a JSON-ready report."""
    need = max(cfg.concurrency)
    rows = []
    for name, examples in sets.items():
        if len(examples) < need:
            raise ValueError(f"{name}: {len(examples)} examples, concurrency {need} needs that many")
        prompts = [example_prompt(engine, ex, cfg.sizes.get(name, 0)) for ex in examples[:need]]  # cached, untimed
        _serve(engine, prompts[:1], cfg)  # warm-up: first-call allocations, thread start-up
        alone = [_serve(engine, [p], cfg) for p in tqdm(prompts, desc=f"{name} alone", disable=not progress)]
        reference = [a["tokens"][0] for a in alone]
        runs: dict[int, list[dict]] = {c: [] for c in cfg.concurrency}
        passes = [c for _ in range(cfg.repeats) for c in cfg.concurrency]
        for c in tqdm(passes, desc=f"{name} batches", disable=not progress):
            runs[c].append(_serve(engine, prompts[:c], cfg))
        hf = {c: hf_decode_rate(engine, prompts[:c], cfg.max_new_tokens) for c in cfg.concurrency} \
            if cfg.hf_baseline else {}
        base = None
        for c in cfg.concurrency:
            got = runs[c]
            tps = statistics.median(g["decode_tokens"] / g["decode_s"] for g in got)
            base = tps if c == min(cfg.concurrency) else base
            ttfts = [t for g in got for t in g["ttft_ms"]]
            ttft = summarize(ttfts)
            rows.append({
                "size": name,
                "concurrency": c,
                "prompt_tokens_mean": statistics.fmean(p.total for p in prompts[:c]),
                "decode_tokens_per_s": tps,
                "decode_tokens_per_s_runs": [g["decode_tokens"] / g["decode_s"] for g in got],
                "decode_speedup_vs_1": tps / base,
                "end_to_end_tokens_per_s": statistics.median(g["generated"] / g["wall_s"] for g in got),
                "mean_decode_batch": statistics.fmean(g["mean_batch"] for g in got),
                "ttft_ms_median": ttft["median"],
                "ttft_ms_p95": ttft["p95"],
                "ttft_ms_max": max(ttfts),
                "ttft_alone_ms_median": statistics.median(a["ttft_ms"][0] for a in alone[:c]),
                "tokens_equal_alone": all(g["tokens"] == reference[:c] for g in got),
                "wall_s": statistics.fmean(g["wall_s"] for g in got),
                **({"hf_decode_tokens_per_s": hf[c], "hf_decode_speedup_vs_1": hf[c] / hf[min(hf)]} if hf else {}),
            })
    method = engine.method(cfg.method, cfg.ratio)
    return {
        "model": engine.name, "dtype": engine.config.dtype, "device": str(engine.adapter.device),
        "threads": torch.get_num_threads(), "method": method.name, "settings": asdict(method.settings),
        "config": {**asdict(cfg), "concurrency": list(cfg.concurrency)}, "rows": rows,
    }


COLUMNS = [("size", "size"), ("concurrency", "requests"), ("prompt_tokens_mean", "prompt tokens"),
           ("decode_tokens_per_s", "decode tok/s"), ("decode_speedup_vs_1", "vs fewest"),
           ("end_to_end_tokens_per_s", "end-to-end tok/s"), ("ttft_ms_median", "TTFT median ms"),
           ("ttft_ms_p95", "TTFT p95 ms"), ("ttft_alone_ms_median", "TTFT alone ms"),
           ("tokens_equal_alone", "tokens = alone")]
HF_COLUMNS = [("hf_decode_tokens_per_s", "HF decode tok/s"), ("hf_decode_speedup_vs_1", "HF vs fewest")]


def _cell(key: str, value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if key.endswith("speedup_vs_1"):
            return f"{value:.2f}x"
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    return str(value)


def format_batch_table(report: dict) -> str:
    columns = COLUMNS + (HF_COLUMNS if report["config"].get("hf_baseline") else [])
    lines = [f"{report['model']} {report['dtype']} on {report['device']}, {report['threads']} threads, "
             f"method {report['method']}, {report['config']['max_new_tokens']} new tokens per request", "",
             "| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in report["rows"]:
        lines.append("| " + " | ".join(_cell(key, row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def plot_batch(report: dict, path: str | Path) -> Path:
    """Decode tokens/s and median TTFT against concurrency, one line per prompt size."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for size in dict.fromkeys(r["size"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["size"] == size]
        xs = [r["concurrency"] for r in rows]
        color = left.plot(xs, [r["decode_tokens_per_s"] for r in rows], "o-", label=size)[0].get_color()
        if "hf_decode_tokens_per_s" in rows[0]:
            left.plot(xs, [r["hf_decode_tokens_per_s"] for r in rows], "s:", color=color, label=f"{size}, HF generate")
        right.plot(xs, [r["ttft_ms_median"] / 1000 for r in rows], "o-", color=color, label=f"{size} median")
        right.plot(xs, [r["ttft_ms_p95"] / 1000 for r in rows], "s:", color=color, label=f"{size} p95")
    left.set(xlabel="concurrent requests", ylabel="decode tokens/s", title="batched decode throughput")
    right.set(xlabel="concurrent requests", ylabel="TTFT (s, queueing included)", title="time to first token")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, f"{report['model']} {report['dtype']}, method {report['method']}")
