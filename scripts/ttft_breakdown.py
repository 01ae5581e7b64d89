"""Where a selective prefill's time goes: TTFT, its attention share and the attention plan, per method.

Every method runs on one example, interleaved, `--repeats` times after an untimed warm-up; the table
gives the median TTFT (and its ratio to the first method's), the median time inside
`sparse_causal_attention`, and per prefill the attention kernel blocks, queries and query-key products
(summed over layers; unmasked prefix products plus the masked products of scattered blocks).

    python scripts/ttft_breakdown.py --data musique --row 100 METHOD [METHOD ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import cachetune.runtime.forward as forward
from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import load_dataset
from cachetune.eval.harness import Variant, prepare

_counts: Counter = Counter()
_attention = forward.sparse_causal_attention


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("methods", nargs="+")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="musique")
    p.add_argument("--row", type=int, default=100)
    p.add_argument("--ratio", type=float, default=EngineConfig.ratio)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    forward.sparse_causal_attention = _counted_attention
    engine = Engine.from_pretrained(config=EngineConfig(model=args.model, threads=args.threads))
    example = load_dataset(args.data, args.row + 1)[args.row]
    variants = [Variant(m, m, args.ratio) for m in args.methods]
    req = prepare(engine, example, variants)
    for v in variants:  # untimed: first-call allocations and thread start-up
        req.start(v, 1)
    runs: dict[str, list[tuple[float, Counter]]] = {v.label: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            _counts.clear()
            _, ms = req.start(v, 1)
            runs[v.label].append((ms, Counter(_counts)))
    print(f"{args.data} row {args.row} ({example.id}), r = {args.ratio}, median of {args.repeats}\n")
    print("| method | TTFT ms | / first method | attention ms | blocks | queries | products (M) | masked (M) |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for label, rows in runs.items():
        ttft = statistics.median(ms for ms, _ in rows)
        base = base or ttft
        attention = statistics.median(c["attention_ms"] for _, c in rows)
        c = rows[-1][1]
        print(f"| {label} | {ttft:.0f} | {ttft / base:.3f} | {attention:.0f} | {c['blocks']} | {c['queries']} "
              f"| {c['products'] / 1e6:.2f} | {c['masked'] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
