"""Deep focus where it is cheap: which requests a `deep_within` threshold sends to deep
focus, and what the selection that results measures, from runs that already measured both choices.

A method with `deep_within=W` picks exactly deep focus's tokens on a request whose predicted price
(methods.signals.deep_focus_price, times the machine's price scale: --scale) is at most W, and exactly
its own settings' tokens elsewhere (tests/test_methods.py::test_deep_within_...). Its KL, TTFT and
answer on a row are therefore those that a run of the chosen selection measured on that row (plus the
price's prediction, which is arithmetic on the prompt's segment lengths). This script computes each
row's price from its prompt (tokenized only: no chunk is encoded, no model pass runs), takes the
chosen selection's rows from the given files (`experiments/selection/selection_kl.py` outputs and `cachetune eval`
progress files, pooled: the first file's row stands), and writes the combined variant's rows in
selection_kl.py's format, named "<shallow>:deep_within=W", for `selection_kl.py --summary` and `--f1`:

    source scripts/selection_methods.sh
    python experiments/selection/deep_within.py --model qwen2.5-coder-1.5b --data musique --rows 0-99 --shallow "$FOCUS" \
      --deep "$D28" --within 0.07 0.08 0.09 --out results/qwen/selection/musique_deep_within.jsonl \
      --files results/qwen/selection/musique_deep_focus.jsonl results/qwen/selection/musique_deep_focus_amd.jsonl \
              results/qwen/selection/musique_deep_focus_answers.jsonl results/qwen/frontier_100rows/eval_musique.progress.jsonl
    python experiments/selection/selection_kl.py --summary results/qwen/selection/musique_deep_within.jsonl \
      results/qwen/frontier_100rows/eval_musique.progress.jsonl --pool --baseline cacheblend \
      --only "$FOCUS:deep_within=0.08" epic

Prints, per threshold, the rows that take deep focus and their prices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import load_dataset
from cachetune.eval.harness import QUESTION_LABEL, TASK_SYSTEM
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.methods.signals import PRICE_SCALE, deep_focus_price
from cachetune.tuning.price import DEEP_DTYPE

sys.path.insert(0, str(Path(__file__).parent))
from selection_kl import read_rows, read_scores  # noqa: E402  (a sibling script)


class Counted:
    """A chunk known by its length alone: all deep_focus_price reads of a cached segment."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens


def prompt_layout(engine: Engine, example) -> PromptLayout:
    """The layout the harness builds for `example` (eval.harness), with its chunks' lengths only."""
    label = "" if example.verbatim else QUESTION_LABEL
    before, after = engine.template.segments(TASK_SYSTEM[example.task], example.question, label)
    chunks = [engine.template.document(doc) for doc in example.documents]
    head = [Segment(before)] if before.numel() else []
    return PromptLayout([*head, *(Segment(ids, Counted(ids.numel())) for ids in chunks), Segment(after)])


def row_numbers(text: str) -> list[int]:
    """"0-99" or "3,5,8-9" -> row numbers."""
    rows = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        rows += range(int(first), int(last or first) + 1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--data", required=True)
    p.add_argument("--rows", required=True, help='rows of the set ("0-99", "3,5,8-9")')
    p.add_argument("--ratio", type=float, default=EngineConfig.ratio)
    p.add_argument("--shallow", required=True, help="the method's own settings (without deep_within)")
    p.add_argument("--deep", required=True, help="deep focus as the runs named it")
    p.add_argument("--within", type=float, nargs="+", required=True)
    p.add_argument("--scale", type=float, default=PRICE_SCALE,
                   help="the machine's measured over predicted price (cachetune calibrate-price) [%(default)s]")
    p.add_argument("--files", nargs="+", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine = Engine.from_pretrained(config=EngineConfig(model=args.model, threads=1))
    rows = row_numbers(args.rows)
    examples = load_dataset(args.data, max(rows) + 1)
    layouts = {examples[r].id: prompt_layout(engine, examples[r]) for r in rows}
    prices = {i: args.scale * deep_focus_price(engine.adapter, layout, args.ratio, DEEP_DTYPE)
              for i, layout in layouts.items()}
    kl: dict[str, dict[str, dict]] = {args.shallow: {}, args.deep: {}}
    score: dict[str, dict[str, float]] = {args.shallow: {}, args.deep: {}}
    for path in args.files:  # as selection_kl.py pools: within a file the last line wins, across files the first file
        own_kl = {(r["variant"], r["id"]): r for r in read_rows(path, args.ratio) if r["variant"] in kl}
        own_score = {(r["variant"], r["id"]): r["score"] for r in read_scores(path, args.ratio) if r["variant"] in score}
        for (variant, i), row in own_kl.items():
            kl[variant].setdefault(i, row)
        for (variant, i), value in own_score.items():
            score[variant].setdefault(i, value)
    lines = []
    for within in args.within:
        name = f"{args.shallow}:deep_within={within:g}"
        deep = [i for i, price in prices.items() if price <= within]
        for i, price in prices.items():
            chosen = args.deep if price <= within else args.shallow
            if i in kl[chosen]:  # answers go on lines of their own (the KL runs' full recompute ran elsewhere)
                measured = {k: kl[chosen][i][k] for k in ("id", "kl", "ttft", "full_ttft", "share", "prompt")}
                if measured["prompt"] != layouts[i].total:  # the price must be the measured prompt's
                    raise SystemExit(f"{i}: {chosen} ran on a {measured['prompt']}-token prompt, this script "
                                     f"builds {layouts[i].total} tokens (another --model, or the harness changed)")
                lines.append({**measured, "variant": name, "price": price, "chosen": chosen})
            if i in score[chosen]:
                lines.append({"id": i, "variant": name, "score": score[chosen][i], "price": price, "chosen": chosen})
        print(f"deep_within={within:g}: {len(deep)} of {len(prices)} rows take deep focus; "
              f"KL rows {sum(1 for x in lines if x['variant'] == name and 'kl' in x)}, "
              f"answer rows {sum(1 for x in lines if x['variant'] == name and 'score' in x and 'kl' not in x)}")
    values = sorted(prices.values())
    print(f"price over {len(values)} rows: min {values[0]:.4f}, median {statistics.median(values):.4f}, "
          f"max {values[-1]:.4f}")
    Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
