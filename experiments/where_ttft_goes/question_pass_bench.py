"""The question pass alone, timed: `question_attention` over one example's prompt, with the pass's
attention reusing the observed probabilities for the question's rows and without (plain causal
attention), interleaved, per signal dtype. The pass's share of a request's TTFT is in
experiments/where_ttft_goes/ttft_breakdown.py; this isolates the pass to compare ways of running it.

    python experiments/where_ttft_goes/question_pass_bench.py --model qwen2.5-coder-1.5b --data musique --row 76 --layers 28 \
        --dtypes bfloat16 int8 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import time

from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import load_dataset
from cachetune.eval.harness import prepare
from cachetune.methods.signals import question_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="musique")
    p.add_argument("--row", type=int, default=76)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8"])
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()
    engine = Engine.from_pretrained(config=EngineConfig(model=args.model, threads=args.threads))
    example = load_dataset(args.data, args.row + 1)[args.row]
    layout = prepare(engine, example, []).prompt()
    print(f"{args.data} row {args.row}: {layout.total} prompt tokens, question pass over {args.layers} layers, "
          f"median of {args.repeats}\n")
    print("| pass dtype | probabilities reused ms | plain attention ms | saved ms |")
    print("|---|---|---|---|")
    for dtype in args.dtypes:
        def run(reuse: bool) -> float:
            start = time.perf_counter()
            question_attention(engine.adapter, layout, args.layers, capacity=layout.total + 40, dtype=dtype,
                               reuse_probs=reuse)
            return (time.perf_counter() - start) * 1e3
        run(True), run(False)  # untimed: casts and first-call allocations
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for reuse in (True, False):
                times[reuse].append(run(reuse))
        reused, plain = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {dtype} | {reused:.0f} | {plain:.0f} | {plain - reused:.0f} |", flush=True)


if __name__ == "__main__":
    main()
