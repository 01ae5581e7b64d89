"""Deep focus's measured price against its prediction, from selection runs that timed it and `first`
in one pass per row: what methods.signals.PRICE_SCALE is, and what `cachetune
calibrate-price` measures on a machine directly.

Per row: the measured price is deep focus's TTFT over `first`'s less one, the predicted one
methods.signals.deep_focus_price on the row's prompt (tokenized only, as experiments/selection/deep_within.py
builds it). The scale is the mean measured over the mean predicted price, with a 95% bootstrap
interval over rows. Each file is one machine's run; pass the files of one machine together.

    source scripts/selection_methods.sh
    python experiments/selection/price_fit.py --model qwen2.5-coder-1.5b --deep "$D28" \\
      --runs 2wikimqa:results/qwen/selection/2wikimqa_deep_focus.jsonl \\
             musique:results/qwen/selection/musique_deep_focus_amd.jsonl \\
             hotpotqa_heldout:results/qwen/selection/hotpotqa_deep_focus.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import load_dataset
from cachetune.eval.metrics import paired_ratio
from cachetune.methods.signals import deep_focus_price
from cachetune.tuning.price import DEEP_DTYPE, FIRST

sys.path.insert(0, str(Path(__file__).parent))
from deep_within import prompt_layout  # noqa: E402  (sibling scripts)
from selection_kl import read_rows  # noqa: E402


def timed_pairs(path: str, deep: str, ratio: float) -> dict[str, tuple[float, float]]:
    """Row id -> (first's TTFT, deep focus's TTFT) where one pass timed both (a row's last line wins)."""
    ttft: dict[str, dict[str, float]] = {}
    for row in read_rows(path, ratio):
        if row["variant"] in (FIRST, deep):
            ttft.setdefault(row["id"], {})[row["variant"]] = row["ttft"]
    return {i: (t[FIRST], t[deep]) for i, t in ttft.items() if len(t) == 2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--deep", required=True, help="deep focus as the runs named it")
    p.add_argument("--runs", nargs="+", required=True, help="DATA:FILE pairs (a dataset name and a run on it)")
    p.add_argument("--ratio", type=float, default=EngineConfig.ratio)
    args = p.parse_args()
    engine = Engine.from_pretrained(config=EngineConfig(model=args.model, threads=1))
    measured, predicted = [], []
    print("| set | id | prompt tokens | measured price | predicted price |\n|---|---|---:|---:|---:|")
    for run in args.runs:
        data, _, path = run.partition(":")
        pairs = timed_pairs(path, args.deep, args.ratio)
        if not pairs:
            raise SystemExit(f"{path}: no row timed both {FIRST} and {args.deep}")
        examples = {ex.id: ex for ex in load_dataset(data)}
        for i in sorted(pairs, key=lambda i: int(i.rsplit("-", 1)[1])):
            layout = prompt_layout(engine, examples[i])
            first, deep = pairs[i]
            measured.append(deep / first - 1)
            predicted.append(deep_focus_price(engine.adapter, layout, args.ratio, DEEP_DTYPE))
            print(f"| {data} | {i} | {layout.total} | {measured[-1]:+.3f} | {predicted[-1]:.3f} |")
    fit = paired_ratio(measured, predicted)
    print(f"\n{len(measured)} rows: mean measured price {sum(measured) / len(measured):.4f}, mean predicted "
          f"{sum(predicted) / len(predicted):.4f}; scale {fit['ratio']:.3f} (95% CI {fit['ci_low']:.3f}-"
          f"{fit['ci_high']:.3f})")


if __name__ == "__main__":
    main()
