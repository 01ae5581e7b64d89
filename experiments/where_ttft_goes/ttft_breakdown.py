"""Where a selective prefill's time goes: TTFT, its attention share and the attention plan, per method.

Every method runs on one example, interleaved, `--repeats` times after an untimed warm-up; the table
gives the median TTFT (and its ratio to the first method's), the median time inside
`sparse_causal_attention` and inside the question's pass (`question_attention`, as the `question`
signal and ProphetKV run it; 0 for methods without one), and per request the attention kernel blocks,
queries and query-key products (summed over layers, the question pass's own included; unmasked prefix
products plus the masked products of scattered blocks).
`--profile-pass` then runs each method once more with its question pass under the CPU profiler and
prints the pass's top ops; `--profile-request` does so for each method's whole request (what a
method adds to `first`'s time, op by op).

    python experiments/where_ttft_goes/ttft_breakdown.py --data musique --row 100 [--profile-pass] [--profile-request] METHOD [...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

import sys

import cachetune.methods  # noqa: F401  (registers every method, so their modules are loaded)
import cachetune.methods.signals as signals
import cachetune.runtime.forward as forward
from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import load_dataset
from cachetune.eval.harness import Variant, prepare

_counts: Counter = Counter()
_attention = forward.sparse_causal_attention
_question_attention = signals.question_attention
_profile_pass = [False]


def _counted_attention(q, k, v, q_pos, scale, sliding_window=None, plan=None):
    """forward's attention, timed, with the size of its plan counted."""
    start = time.perf_counter()
    out = _attention(q, k, v, q_pos, scale, sliding_window, plan=plan)
    _counts["attention_ms"] += (time.perf_counter() - start) * 1e3
    for blk in plan or []:
        queries = blk.stop - blk.start
        masked_span = blk.last - blk.first + 1 if blk.mask is not None else 0
        _counts["blocks"] += 1
        _counts["queries"] += queries
        _counts["products"] += queries * (blk.first + masked_span)
        _counts["masked"] += queries * masked_span
    return out


def _top_ops(run, rows: int):
    """run() under the CPU profiler; prints its `rows` top ops by self time and returns its result."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
    return out


def _counted_pass(*args, **kwargs):
    """The question's pass, timed (and profiled under --profile-pass)."""
    start = time.perf_counter()
    if not _profile_pass[0]:
        out = _question_attention(*args, **kwargs)
    else:
        out = _top_ops(lambda: _question_attention(*args, **kwargs), 12)
    _counts["pass_ms"] += (time.perf_counter() - start) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("methods", nargs="+")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="musique")
    p.add_argument("--row", type=int, default=100)
    p.add_argument("--ratio", type=float, default=EngineConfig.ratio)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-pass", action="store_true", help="then profile each method's question pass")
    p.add_argument("--profile-request", action="store_true", help="then profile each method's whole request")
    args = p.parse_args()
    forward.sparse_causal_attention = _counted_attention
    # Every method module that bound the question's pass by name (the selection's and ProphetKV's).
    for name, module in list(sys.modules.items()):
        if (name.startswith("cachetune.methods.") and module is not signals
                and getattr(module, "question_attention", None) is _question_attention):
            module.question_attention = _counted_pass
    # deep_within=0: a name that does not set deep focus means the selection it spells (as before the default).
    engine = Engine.from_pretrained(config=EngineConfig(model=args.model, threads=args.threads, deep_within=0))
    example = load_dataset(args.data, args.row + 1)[args.row]
    variants = [Variant(m, m, args.ratio) for m in args.methods]
    req = prepare(engine, example, variants)
    for v in variants:  # untimed: first-call allocations and thread start-up
        req.start(v, 1)
    runs: dict[str, list[tuple[float, Counter]]] = {v.label: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            _counts.clear()
            ms = req.start(v, 1).ttft_ms
            runs[v.label].append((ms, Counter(_counts)))
    print(f"{args.data} row {args.row} ({example.id}), r = {args.ratio}, median of {args.repeats}\n")
    print("| method | TTFT ms | / first method | attention ms | question pass ms | blocks | queries | products (M) "
          "| masked (M) |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for label, rows in runs.items():
        ttft = statistics.median(ms for ms, _ in rows)
        base = base or ttft
        attention = statistics.median(c["attention_ms"] for _, c in rows)
        signal_pass = statistics.median(c["pass_ms"] for _, c in rows)
        c = rows[-1][1]
        print(f"| {label} | {ttft:.0f} | {ttft / base:.3f} | {attention:.0f} | {signal_pass:.0f} | {c['blocks']} "
              f"| {c['queries']} | {c['products'] / 1e6:.2f} | {c['masked'] / 1e6:.2f} |")
    _profile_pass[0] = args.profile_pass
    for v in variants if args.profile_pass else []:
        print(f"\n{v.label}: its question pass's top ops, if it has one", flush=True)
        req.start(v, 1)
    _profile_pass[0] = False
    for v in variants if args.profile_request else []:
        print(f"\n{v.label}: its whole request's top ops", flush=True)
        _top_ops(lambda: req.start(v, 1), 20)


if __name__ == "__main__":
    main()
