"""The selection bars (docs/results.md, "How these numbers were measured"), paired per example,
from `cachetune eval` progress files (resumable runs' JSONL).

The default selection (or, with --subject, a candidate for the default: `layers6`, the question
read over 6 layers; `starts`, its chunk starts alone; `focus`, the rest shared by the question's
mass per chunk) at the bars' ratio against every other method (at that ratio where it has one), on the
examples both ran: mean KL to full recompute, the mean per-example KL difference with
its 95% bootstrap interval and the examples each wins, top-1 agreement with full recompute along
its answer (per-example means, the paired difference's interval), F1 over full recompute's, and TTFT as the
geometric mean of per-example ratios to `first` (each chunk's first r; eval.report.paired_comparison).

    python experiments/selection/bars.py results/smollm2/frontier/eval_*.progress.jsonl [--limit N] [--md OUT.md]
                           [--subject default|layers6|starts|focus] [--agree-with DIR]

--agree-with DIR also checks each file against DIR's file of the same name (the same examples run
elsewhere, e.g. on a GPU and on a CPU): KL and the greedy answer do not depend on timing, so they
must agree within float noise, or the two runs selected or computed differently.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

from cachetune.eval.report import paired_comparison
from cachetune.methods.full_recompute import FULL_RECOMPUTE

RATIO = 0.15


SELECTION_METHODS = Path(__file__).resolve().parents[2] / "scripts" / "selection_methods.sh"


def method_names(path: Path = SELECTION_METHODS) -> dict[str, str]:
    """The methods named in full in scripts/selection_methods.sh (the one list the frontier and the
    GPU check source): its plain NAME=value lines, those that expand no other name."""
    names = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.isidentifier() and "$" not in value:
            names[name] = value.strip()
    return names


_NAMES = method_names()
FIRST, DEFAULT, LAYERS6, STARTS, FOCUS = (_NAMES[n] for n in ("FIRST", "DEFAULT", "CANDIDATE", "STARTS", "FOCUS"))
SUBJECTS = {"default": DEFAULT, "layers6": LAYERS6, "starts": STARTS, "focus": FOCUS}
OTHERS = ("epic", "cacheblend", "prophetkv", FIRST, DEFAULT, LAYERS6, STARTS, FOCUS, "full_reuse", "c2kv", "kvlink",
          "block_attention")
SHORT = {FIRST: "first", DEFAULT: "default", LAYERS6: "6 layers", STARTS: "starts alone", FOCUS: "focus"}


def load_records(path: Path, limit: int | None = None) -> list[dict]:
    """The per-example records of one progress file, the first `limit` examples of it with a limit.

    As in a resumed run, an example's last line wins (a resumed run appends the example again with
    the variants it added), and a torn last line (a run cut off mid-write) is skipped."""
    records: dict[tuple[str, str], dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)["record"]
        except (json.JSONDecodeError, KeyError):
            continue
        records[(record["dataset"], record["id"])] = record  # re-insertion keeps the first position
    return list(records.values())[:limit]


def at_ratio(records: list[dict], method: str) -> str:
    """The label `method` has in these records: `<method>@<ratio>` when a sweep ran it, else plain."""
    swept = f"{method}@{RATIO:g}"
    return swept if any(swept in r["methods"] for r in records) else method


def machines(records: list[dict], label: str) -> str:
    """Where `label`'s timings came from: each device with its example count, most first (records
    from before the harness named the device count as "unrecorded")."""
    counts = Counter(r["methods"][label].get("device", "unrecorded") for r in records if label in r["methods"])
    return ", ".join(f"{device} ({n})" for device, n in counts.most_common())


def agreement(records: list[dict], others: list[dict]) -> dict | None:
    """Over the (example, method) pairs both record lists ran (full recompute, the reference, left
    out): how many, the largest and the median |KL difference|, and how many greedy answers are the
    same. None when they share no pair."""
    theirs = {(r["dataset"], r["id"]): r["methods"] for r in others}
    diffs, same = [], 0
    for r in records:
        for method, mine in r["methods"].items():
            other = theirs.get((r["dataset"], r["id"]), {}).get(method)
            if method == FULL_RECOMPUTE or other is None or "kl" not in mine or "kl" not in other:
                continue
            diffs.append(abs(mine["kl"] - other["kl"]))
            same += mine.get("answer") == other.get("answer")
    if not diffs:
        return None
    return {"pairs": len(diffs), "max_abs_kl_diff": max(diffs), "median_abs_kl_diff": statistics.median(diffs),
            "same_answer": same}


def agreement_line(path: Path, other: Path) -> str:
    a = agreement(load_records(path), load_records(other))
    if a is None:
        return f"{path} and {other} share no (example, method) pair"
    return (f"{path} against {other}: {a['pairs']} (example, method) pairs, |KL difference| max "
            f"{a['max_abs_kl_diff']:.2e}, median {a['median_abs_kl_diff']:.2e}; same greedy answer "
            f"{a['same_answer']} / {a['pairs']}")


def table(path: Path, limit: int | None = None, subject: str = "default") -> str:
    records = load_records(path, limit)
    name = SUBJECTS[subject]
    mine, first = at_ratio(records, name), at_ratio(records, FIRST)
    s = SHORT[name]
    out = [f"{path}: {len(records)} examples, r = {RATIO:g}; {s} timed on {machines(records, mine)}", "",
           f"| vs | n | KL {s} | KL it | diff (95% CI) | wins {s} / it | top-1 {s} / it, diff (95% CI) "
           f"| F1/full {s} (95% CI) | F1/full it (95% CI) | TTFT/first {s} (95% CI) | TTFT/first it |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method in OTHERS:
        if method == name:
            continue
        c = paired_comparison(records, mine, at_ratio(records, method), first)
        if c is None:
            continue
        q, qo, (lo, hi), (tlo, thi) = (c["quality_vs_full"], c["other_quality_vs_full"], c["kl_diff_ci"],
                                       c["ttft_vs_base_ci"])
        t_lo, t_hi = c["top1_diff_ci"]
        out.append(
            f"| {SHORT.get(method, method)} | {c['n_examples']} | {c['kl']:.4f} | {c['other_kl']:.4f} "
            f"| {c['kl_diff']:+.4f} ({lo:+.4f}, {hi:+.4f}) | {c['wins']} / {c['other_wins']} "
            f"| {c['top1']:.3f} / {c['other_top1']:.3f}, {c['top1_diff']:+.3f} ({t_lo:+.3f}, {t_hi:+.3f}) "
            f"| {q['ratio']:.2f} ({q['ci_low']:.2f}-{q['ci_high']:.2f}) "
            f"| {qo['ratio']:.2f} ({qo['ci_low']:.2f}-{qo['ci_high']:.2f}) "
            f"| {c['ttft_vs_base']:.3f} ({tlo:.3f}-{thi:.3f}) | {c['other_ttft_vs_base']:.3f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("progress", nargs="+", type=Path, help="eval progress files (*.progress.jsonl)")
    parser.add_argument("--limit", type=int, help="only each file's first N examples (what fewer examples said)")
    parser.add_argument("--md", type=Path, help="also write the tables here")
    parser.add_argument("--subject", choices=sorted(SUBJECTS), default="default",
                        help="whose bars: the default selection's, or a candidate's for the default")
    parser.add_argument("--agree-with", type=Path, metavar="DIR",
                        help="also check KL and answers against DIR's progress file of the same name")
    args = parser.parse_args()
    parts = [table(p, args.limit, args.subject) for p in args.progress]
    if args.agree_with:
        parts += [agreement_line(p, args.agree_with / p.name) for p in args.progress]
    text = "\n\n".join(parts) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
