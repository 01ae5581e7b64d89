"""`cachetune bench`: every method on the same examples, timed in one run against full recompute.

Per example the chunks are cached first (not timed: encoding is a one-off per chunk). Then each
method serves the request; TTFT covers everything a request pays (layout, selection, loading,
prefill, first token). Full recompute runs first on each example because its greedy answer is the
reference: every method is then teacher-forced on that answer to measure next-token fidelity
(KL(full || method), top-1 agreement), and decodes its own greedy answer for answer match and F1.
Extra timing passes (`repeats`) rotate the method order so no method always runs first.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from functools import partial

from cachetune.engine.decode import SamplingConfig, generate_tokens
from cachetune.engine.engine import FULL_RECOMPUTE, METHODS, Engine
from cachetune.eval.datasets import QAExample
from cachetune.eval.metrics import f1_score, kl_to_reference, summarize, top1_agreement

DOCUMENT_SEPARATOR = "\n\n"  # appended to every document so chunks read as separate passages


@dataclass
class BenchConfig:
    methods: list[str] = field(default_factory=lambda: [FULL_RECOMPUTE, "full_reuse", "cachetune"])
    ratio: float = 0.15
    max_new_tokens: int = 32
    repeats: int = 0          # extra timing-only passes per example, method order rotated
    warmup: bool = True       # one untimed request per method before the first measurement
    system: str | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if FULL_RECOMPUTE not in self.methods:
            # Every fidelity metric and every speedup is relative to full recompute.
            self.methods = [FULL_RECOMPUTE, *self.methods]
        self.methods = [FULL_RECOMPUTE] + [m for m in self.methods if m != FULL_RECOMPUTE]


@dataclass
class MethodStats:
    ttft_ms: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)          # per example: mean over answer positions
    top1: list[float] = field(default_factory=list)        # per position
    match: list[float] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    recomputed_share: list[float] = field(default_factory=list)


def _teacher_forced_logits(engine: Engine, result, answer: list[int]) -> torch.Tensor:
    """Next-token logits at the prompt end and after each answer token: [len(answer) + 1, vocab]."""
    first = result.logits.unsqueeze(0)
    if not answer:
        return first
    rest = result.extend(engine.adapter, answer)
    result.cache.truncate(result.prompt_tokens)
    return torch.cat([first, rest])


def run_example(engine: Engine, ex: QAExample, cfg: BenchConfig, stats: dict[str, MethodStats]) -> dict:
    ids = [engine.cache_chunk(doc + DOCUMENT_SEPARATOR) for doc in ex.documents]
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    record: dict = {"id": ex.id, "methods": {}}
    ref_answer: list[int] = []
    ref_logits = None
    for method in cfg.methods:
        result, ttft = engine.start_request(ids, ex.question, cfg.system, method, cfg.ratio, cfg.max_new_tokens + 1)
        s = stats[method]
        s.ttft_ms.append(ttft)
        chunk_tokens = sum(engine.chunk(c).num_tokens for c in ids)
        s.recomputed_share.append(result.recomputed_chunk_tokens / max(chunk_tokens, 1))
        if method == FULL_RECOMPUTE:
            ref_answer = generate_tokens(partial(result.extend, engine.adapter), result.logits, sampling, engine.stop_ids())
            result.cache.truncate(result.prompt_tokens)
            ref_logits = _teacher_forced_logits(engine, result, ref_answer)
            answer = ref_answer
        else:
            logits = _teacher_forced_logits(engine, result, ref_answer)
            s.kl.append(float(kl_to_reference(ref_logits, logits).mean()))
            s.top1.extend(top1_agreement(ref_logits, logits).float().tolist())
            answer = generate_tokens(partial(result.extend, engine.adapter), result.logits, sampling, engine.stop_ids())
        if method == FULL_RECOMPUTE:
            s.kl.append(0.0)
            s.top1.extend([1.0] * (len(ref_answer) + 1))
        text = engine.tokenizer.decode(answer, skip_special_tokens=True)
        s.match.append(float(answer == ref_answer))
        s.f1.append(f1_score(text, ex.answers))
        record["methods"][method] = {"ttft_ms": ttft, "answer": text, "f1": s.f1[-1]}
    for r in range(cfg.repeats):
        order = cfg.methods[r + 1 :] + cfg.methods[: r + 1]
        for method in order:
            _, ttft = engine.start_request(ids, ex.question, cfg.system, method, cfg.ratio, 1)
            stats[method].ttft_ms.append(ttft)
    return record


def run_bench(engine: Engine, examples: list[QAExample], cfg: BenchConfig, progress: bool = True) -> dict:
    stats = {m: MethodStats() for m in cfg.methods}
    if cfg.warmup and examples:
        ex = examples[0]
        ids = [engine.cache_chunk(doc + DOCUMENT_SEPARATOR) for doc in ex.documents]
        for method in cfg.methods:
            engine.start_request(ids, ex.question, cfg.system, method, cfg.ratio, 1)
    records = [run_example(engine, ex, cfg, stats) for ex in tqdm(examples, desc="bench", disable=not progress)]
    full_median = statistics.median(stats[FULL_RECOMPUTE].ttft_ms)
    results = []
    for method in cfg.methods:
        s = stats[method]
        t = summarize(s.ttft_ms)
        results.append({
            "method": method,
            "ratio": {FULL_RECOMPUTE: 1.0, "full_reuse": 0.0}.get(method, cfg.ratio),
            "ttft_ms_median": t["median"],
            "ttft_ms_p95": t["p95"],
            "speedup_vs_full": full_median / t["median"],
            "kl_to_full": statistics.fmean(s.kl),
            "top1_agree": statistics.fmean(s.top1),
            "answer_match_full": statistics.fmean(s.match),
            "f1": statistics.fmean(s.f1),
            "recomputed_share": statistics.fmean(s.recomputed_share),
        })
    return {
        "model": engine.name,
        "dtype": engine.config.dtype,
        "threads": torch.get_num_threads(),
        "n_examples": len(examples),
        "config": asdict(cfg),
        "results": results,
        "examples": records,
    }


def format_table(report: dict) -> str:
    """A markdown table of the results, one row per method."""
    cols = ["method", "ratio", "ttft_ms_median", "ttft_ms_p95", "speedup_vs_full", "kl_to_full",
            "top1_agree", "answer_match_full", "f1", "recomputed_share"]
    lines = [
        f"model {report['model']} ({report['dtype']}, {report['threads']} threads), {report['n_examples']} examples",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in report["results"]:
        cells = [row[c] if isinstance(row[c], str) else f"{row[c]:.3f}" if abs(row[c]) < 100 else f"{row[c]:.0f}"
                 for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
