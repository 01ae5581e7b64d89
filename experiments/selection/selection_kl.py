"""Fidelity-only comparison of selections: KL to full recompute and TTFT.

Every variant is teacher-forced on full recompute's greedy answer (no answer of its own is decoded,
so many variants fit in one run) and its time to first token measured once per example, in the same
run as every other variant. Resumable: rows already in the output file are skipped.

    python experiments/selection/selection_kl.py --data hotpotqa_heldout --limit 12 [--skip N] --variants FILE --out OUT.jsonl
    python experiments/selection/selection_kl.py --data musique --rows 37,43,48 --variants FILE --out OUT.jsonl
    python experiments/selection/selection_kl.py --model qwen2.5-coder-1.5b --dtype bfloat16 --data hotpotqa_train --limit 30 --chunk-tokens 128 --variants FILE --out OUT.jsonl
    python experiments/selection/selection_kl.py --summary OUT.jsonl [...] [--baseline VARIANT] [--pool] [--only VARIANT ...]
                                   [--plot PNG [--title T] [--ttft-bar 1.10]]
    python experiments/selection/selection_kl.py --data musique --rows 0,1 --answers --variants FILE --out ANSWERS.jsonl
    python experiments/selection/selection_kl.py --f1 ANSWERS.jsonl EVAL.progress.jsonl [...] [--only VARIANT ...]

--summary also reads `cachetune eval` progress files (the same KL: teacher-forced on full
recompute's greedy answer), each method at --ratio, so a frontier run's examples and this script's
can be compared, or with --pool read as one sample. Pooled files may share examples: an example's
variants are then joined across them (the KL of a variant on an example is deterministic, so one
that two files both ran must agree to 1e-4 of its value, or the files were run with other settings
and are refused).
TTFT is compared as each row's ratio to the full recompute timed with it, which is the plain ratio
within one run and stays fair across runs.

Every row also holds the variant's own greedy answer, scored against the gold answers as `cachetune
eval` scores it (F1 on QA), and full recompute's score ("full_score"). --answers decodes and scores the
answers alone, with no reference pass (no KL, no full recompute's score: a frontier run's progress file
of the same rows has it), for rows whose KL another run has. --f1 reads these files and progress files
(an example's scores joined across them, the first file's standing) and gives each variant's mean
score over full recompute's on the examples every shown variant has, with a paired bootstrap interval
(the answer bar: Qwen F1 at least 95% of full recompute's).

FILE holds one method spec per line ("cachetune:first:allocation=focus:signal=question", ...);
plain "cachetune" is each chunk's top r by the `first` ranking alone (what the default was before).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import load_dataset, rechunk
from cachetune.eval.harness import Variant, _teacher_forced_logits, prepare
from cachetune.eval.metrics import bootstrap_mean, kl_to_reference, paired_ratio, score_answer
from cachetune.eval.report import pyplot, save_figure
from cachetune.methods.full_recompute import FULL_RECOMPUTE


def run(args) -> None:
    specs = [line.strip() for line in Path(args.variants).read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    # Every variant means what its name spells: no selection setting comes from the engine's defaults.
    config = EngineConfig(model=args.model, threads=args.threads, dtype=args.dtype, allocation="proportional",
                          signal="none", deep_within=0)
    engine = Engine.from_pretrained(config=config)
    out = Path(args.out)
    done = set()
    if out.exists():  # a KL run and an answers run each resume from their own kind of row
        field = "score" if args.answers else "kl"
        done = {(r["id"], r["variant"]) for r in parsed_lines(out) if field in r}
        text = out.read_bytes()
        if text and not text.endswith(b"\n"):  # a torn last line: the next row starts on a line of its own
            with out.open("a") as f:
                f.write("\n")
    full = Variant(FULL_RECOMPUTE, FULL_RECOMPUTE, args.ratio)
    variants = [Variant(s, s, args.ratio) for s in specs]
    warm = False
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        examples = pick_rows(args.data, args.limit, args.skip, args.rows)
        if args.chunk_tokens:  # ids become ROW@Nt, as `cachetune eval --chunk-tokens` names them
            count = lambda text: int(engine.template.encode(text).numel())  # noqa: E731
            examples = [rechunk(ex, args.chunk_tokens, count) for ex in examples]
        for ex in tqdm(examples, desc=args.data, unit="example"):
            todo = [v for v in variants if (ex.id, v.label) not in done]
            if not todo:
                continue
            if args.answers:
                answer_rows(engine, ex, todo, f, warm)
                warm = True
                continue
            req = prepare(engine, ex, [full, *todo])
            if not warm:  # untimed: first-call allocations and thread start-up
                for v in [full, *todo]:
                    req.start(v, 1)
                warm = True
            started = req.start(full, 40)
            result, full_ms = started.prefill, started.ttft_ms
            answer = req.decode(full, started)
            _, full_score = scored(engine, ex, answer)
            result.cache.truncate(result.prompt_rows)
            reference = _teacher_forced_logits(engine, result, answer)
            chunk_tokens = sum(engine.chunk(c).num_tokens for c in req.chunk_ids)
            for v in todo:
                started = req.start(v, 40)
                result, ms = started.prefill, started.ttft_ms
                kl = float(kl_to_reference(reference, _teacher_forced_logits(engine, result, answer)).mean())
                text, score = scored(engine, ex, req.decode(v, started))
                f.write(json.dumps({"id": ex.id, "variant": v.label, "kl": kl, "ttft": ms, "full_ttft": full_ms,
                                    "share": result.recomputed_chunk_tokens / max(1, chunk_tokens),
                                    "prompt": result.prompt_tokens, "answer": text, "score": score,
                                    "full_score": full_score}) + "\n")
                f.flush()


def answer_rows(engine: Engine, ex, variants: list[Variant], f, warm: bool) -> None:
    """Each variant's own greedy answer on `ex` and its score, one row per variant written to `f`."""
    req = prepare(engine, ex, variants)
    if not warm:  # untimed: first-call allocations and thread start-up
        for v in variants:
            req.start(v, 1)
    chunk_tokens = sum(engine.chunk(c).num_tokens for c in req.chunk_ids)
    for v in variants:
        started = req.start(v, req.sampling.max_new_tokens + 1)
        result, ms = started.prefill, started.ttft_ms
        text, score = scored(engine, ex, req.decode(v, started))
        f.write(json.dumps({"id": ex.id, "variant": v.label, "score": score, "answer": text, "ttft": ms,
                            "share": result.recomputed_chunk_tokens / max(1, chunk_tokens),
                            "prompt": result.prompt_tokens}) + "\n")
        f.flush()


def scored(engine: Engine, ex, answer: list[int]) -> tuple[str, float]:
    """A greedy answer's text and its score against the gold answers, as `cachetune eval` scores it."""
    text = engine.tokenizer.decode(answer, skip_special_tokens=True)
    return text, score_answer(ex.task, text, ex.answers)


def pick_rows(data: str, limit: int | None, skip: int = 0, rows: str | None = None) -> list:
    """The set's examples [skip:limit], or with `rows` ("37,43,48") those rows of the set, in that order."""
    if rows is None:
        return load_dataset(data, limit)[skip:]
    try:
        picked = [int(r) for r in rows.split(",") if r.strip()]
    except ValueError:
        picked = []
    if not picked or min(picked) < 0:
        raise ValueError(f"--rows wants row numbers >= 0, got {rows!r}")
    examples = load_dataset(data, max(picked) + 1)
    if max(picked) >= len(examples):
        raise ValueError(f"--rows: {data} has {len(examples)} rows, asked for row {max(picked)}")
    return [examples[r] for r in picked]


def parsed_lines(path: str | Path):
    """The JSON objects of a JSONL file, skipping a torn last line (a run cut off mid-write)."""
    for line in Path(path).read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def at_ratio(label: str, ratio: float) -> str | None:
    """A progress file's method label ("<method>" or a swept "<method>@<r>") -> the method's name
    when it ran at `ratio` (an unswept label counts), else None."""
    name, _, at = label.partition("@")
    return None if at and float(at) != ratio else name


def read_rows(path: str | Path, ratio: float) -> list[dict]:
    """This script's rows from its output file, or from a `cachetune eval` progress file: each
    method of each example at `ratio` (a swept method's "<method>@<ratio>" named "<method>"), an
    example's last line winning as when the run resumed."""
    rows = []
    for item in parsed_lines(path):
        if "record" not in item:
            if "kl" in item:  # an answers run's rows carry no KL
                rows.append(item)
            continue
        record = item["record"]
        full_ms = record["methods"][FULL_RECOMPUTE]["ttft_ms"]
        for label, m in record["methods"].items():
            name = at_ratio(label, ratio)
            if label == FULL_RECOMPUTE or "kl" not in m or name is None:
                continue
            # A variant added to a resumed example carries the full recompute timed in its pass.
            rows.append({"id": record["id"], "variant": name, "kl": m["kl"],
                         "ttft": statistics.median(m["ttft_ms"]),
                         "full_ttft": statistics.median(m.get("full_ttft_ms", full_ms)),
                         "share": m["recomputed_share"], "prompt": record["prompt_tokens"]})
    return rows


def read_scores(path: str | Path, ratio: float) -> list[dict]:
    """{"id", "variant", "score"} rows: an answers run's (--answers), or a progress file's methods at
    `ratio` (full recompute's too), as read_rows reads them."""
    rows = []
    for item in parsed_lines(path):
        if "record" not in item:
            if "score" in item:
                rows.append({"id": item["id"], "variant": item["variant"], "score": item["score"]})
            if "full_score" in item:  # a KL run's rows carry the reference's score too
                rows.append({"id": item["id"], "variant": FULL_RECOMPUTE, "score": item["full_score"]})
            continue
        for label, m in item["record"]["methods"].items():
            name = at_ratio(label, ratio)
            if "score" in m and name is not None:
                rows.append({"id": item["record"]["id"], "variant": name, "score": m["score"]})
    return rows


def f1_summary(paths: list[str], ratio: float = EngineConfig.ratio, only: list[str] | None = None) -> str:
    """Markdown: each variant's mean answer score over full recompute's, on the examples every shown
    variant and full recompute have (all files pooled: within a file an example's last line wins, as
    when a run resumed; across files the first file's score stands), with a
    paired 95% bootstrap interval and the examples it scores above / below full recompute on.
    Shown: `only`, else every variant."""
    by: dict[str, dict[str, float]] = defaultdict(dict)
    for path in paths:
        own: dict[str, dict[str, float]] = defaultdict(dict)
        for row in read_scores(path, ratio):
            own[row["variant"]][row["id"]] = row["score"]
        for variant, scores in own.items():
            by[variant] = {**scores, **by[variant]}
    full = by.get(FULL_RECOMPUTE)
    if not full:
        raise SystemExit(f"--f1: no {FULL_RECOMPUTE} scores in {', '.join(paths)} (add the frontier's progress file)")
    names = only or [v for v in by if v != FULL_RECOMPUTE]
    missing = [v for v in names if v not in by]
    if missing:
        raise SystemExit(f"--f1: no scores of {', '.join(missing)} (known: {', '.join(by)})")
    ids = sorted(set(full).intersection(*(by[v] for v in names)))
    if not ids:
        raise SystemExit(f"--f1: no example has scores of full recompute and of every one of {', '.join(names)}")
    lines = ["| variant | examples | score | full recompute | score / full (95% CI) | above / below full |",
             "|---|---|---|---|---|---|"]
    ref = [full[i] for i in ids]
    for v in names:
        scores = [by[v][i] for i in ids]
        r = paired_ratio(scores, ref)
        lines.append(f"| {v} | {len(ids)} | {statistics.fmean(scores):.3f} | {statistics.fmean(ref):.3f} "
                     f"| {r['ratio']:.2f} ({r['ci_low']:.2f}-{r['ci_high']:.2f}) | {r['better']:.0f} / {r['worse']:.0f} |")
    return "\n".join(lines)


def over_full(row: dict) -> float:
    """The row's TTFT over the full recompute timed in its own run."""
    return row["ttft"] / row["full_ttft"]


def compare(paths: list[str], baseline: str = "cachetune", ratio: float = EngineConfig.ratio,
            pool: bool = False, only: list[str] | None = None) -> list[dict]:
    """Per file (or, with `pool`, for all files as one sample, an example's variants joined across
    files), on the examples every shown variant has: {"name", "baseline", "examples", "prompt" (mean
    tokens), "rows"}, each row a variant's mean KL, its paired difference to `baseline` (mean per-example
    KL(variant) - KL(baseline), "diff" with its 95% bootstrap interval "low", "high") and the examples
    each of the two has the lower KL on ("lower", "higher"; Qwen's KL is heavy-tailed, so the counts
    say what a mean may hide), its mean per-example TTFT ratio to `baseline` ("ttft"), each over the
    full recompute timed in its own run, against the baseline's row in the variant's own file where
    that file timed it (one machine, one pass: runs on other CPUs price full recompute differently),
    and its recomputed share. Shown: `only` and the baseline where given, else the variants every
    file has."""
    groups = {" + ".join(paths): paths} if pool else {p: [p] for p in paths}
    out = []
    for name, files in groups.items():
        by: dict[str, dict[str, dict]] = defaultdict(dict)
        in_files: dict[str, set[int]] = defaultdict(set)
        timed_with: dict[tuple[int, str], dict] = {}  # (file, example) -> the baseline's row in that file
        for n, path in enumerate(files):
            for row in read_rows(path, ratio):
                if row["variant"] == baseline:
                    timed_with[(n, row["id"])] = row
                seen = by[row["variant"]].get(row["id"])
                in_files[row["variant"]].add(n)
                if seen is not None and seen["file"] != n:
                    # Other CPUs' float32 kernels move the last digits (1.4e-6 seen); other settings move percents.
                    if abs(seen["kl"] - row["kl"]) > 1e-4 * max(1.0, abs(seen["kl"])):
                        raise SystemExit(f"--pool: {row['variant']} on {row['id']} has KL {seen['kl']:.6f} in one "
                                         f"file and {row['kl']:.6f} in {path}: runs with other settings")
                    continue  # the same example in another file: the first file's row stands
                by[row["variant"]][row["id"]] = {**row, "file": n}  # in one file, the last row wins
        if baseline not in by:
            raise SystemExit(f"{name}: no rows of the baseline {baseline!r} (--baseline names one of: {', '.join(by)})")
        if only:
            missing = [v for v in only if v not in by]
            if missing:
                raise SystemExit(f"{name}: no rows of {', '.join(missing)} (--only names some of: {', '.join(by)})")
            variants = {v: by[v] for v in dict.fromkeys([baseline, *only])}
        else:  # the variants every file has, on the examples all of them have
            variants = {v: rows for v, rows in by.items() if len(in_files[v]) == len(files)}
        ids = set.intersection(*(set(rows) for rows in variants.values()))
        base = by[baseline]
        order = sorted(ids)  # a fixed order, so the bootstrap resamples the same examples every time

        def beside(row: dict) -> dict:
            """The baseline's row a row's TTFT is compared with: its own file's where that file has one."""
            return timed_with.get((row["file"], row["id"]), base[row["id"]])

        rows = []
        for variant, mine in variants.items():
            diffs = [mine[i]["kl"] - base[i]["kl"] for i in order]
            low, high = bootstrap_mean(diffs)
            rows.append({"variant": variant, "kl": statistics.fmean(mine[i]["kl"] for i in ids),
                         "diff": statistics.fmean(diffs), "low": low, "high": high,
                         "lower": sum(d < 0 for d in diffs), "higher": sum(d > 0 for d in diffs),
                         "ttft": statistics.fmean(over_full(mine[i]) / over_full(beside(mine[i])) for i in ids),
                         "share": statistics.fmean(mine[i]["share"] for i in ids)})
        out.append({"name": name, "baseline": baseline, "examples": len(ids),
                    "prompt": statistics.fmean(base[i]["prompt"] for i in ids), "rows": rows})
    return out


def summary(paths: list[str], baseline: str = "cachetune", ratio: float = EngineConfig.ratio,
            pool: bool = False, only: list[str] | None = None) -> str:
    """Markdown: compare()'s tables, one per file or one for the pooled files."""
    return tables(compare(paths, baseline, ratio, pool, only))


def tables(groups: list[dict]) -> str:
    """Markdown: one table per compare() group."""
    parts = []
    for group in groups:
        parts += [f"{group['name']}: {group['examples']} examples, ~{group['prompt']:.0f} prompt tokens",
                  "", "| variant | KL to full | KL - baseline (95% CI) | lower KL: variant / baseline "
                  "| TTFT / baseline | recomputed share |", "|---|---|---|---|---|---|"]
        for r in group["rows"]:
            parts.append(f"| {r['variant']} | {r['kl']:.4f} | {r['diff']:+.4f} ({r['low']:+.4f}, {r['high']:+.4f}) "
                         f"| {r['lower']} / {r['higher']} | {r['ttft']:.2f} | {r['share']:.3f} |")
        parts.append("")
    return "\n".join(parts)


def plot_summary(groups: list[dict], path: str | Path, title: str, ttft_bar: float | None = None,
                 names: dict[str, str] | None = None) -> Path:
    """KL to full against TTFT over the baseline, one panel per compare() group, each variant a point
    labelled by `names` (spec -> short name) where it has one; `ttft_bar` shades the TTFT the bar allows."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
    for ax, group in zip(axes[0], groups):
        if ttft_bar is not None:
            ax.axvspan(min(r["ttft"] for r in group["rows"]) - 0.02, ttft_bar, color="green", alpha=0.08)
        for i, r in enumerate(group["rows"]):
            label = short_name(r["variant"], names or {})
            ax.scatter([r["ttft"]], [r["kl"]], s=45, color=plt.cm.tab10(i % 10), marker="osD^v<>ph*"[i % 10])
            ax.annotate(label, (r["ttft"], r["kl"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(f"TTFT over {short_name(group['baseline'], names or {})}'s (mean per-example ratio)")
        ax.set_ylabel("KL to full recompute (lower is better)")
        ax.set_title(f"{Path(group['name'].split(' + ')[0]).stem} ({group['examples']} ex.)", fontsize=9)
        ax.grid(alpha=0.3)
    return save_figure(fig, path, title)


def short_name(spec: str, names: dict[str, str]) -> str:
    """`spec` with the longest named spec it starts with replaced by that name ("$FOCUS:deep_within=0.08"
    -> "focus:deep_within=0.08"), else `spec` itself."""
    for full in sorted(names, key=len, reverse=True):
        if spec == full or spec.startswith(full + ":"):
            return names[full] + spec[len(full):]
    return spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data")
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--chunk-tokens", type=int, help="cut each row's documents again into chunks of about N "
                   "tokens on sentence boundaries (as `cachetune eval --chunk-tokens`)")
    p.add_argument("--limit", type=int)
    p.add_argument("--skip", type=int, default=0, help="leave out the first SKIP of the --limit examples")
    p.add_argument("--rows", help="run these rows of the set only (\"37,43,48\"; instead of --limit/--skip)")
    p.add_argument("--ratio", type=float, default=EngineConfig.ratio)
    p.add_argument("--variants")
    p.add_argument("--out")
    p.add_argument("--answers", action="store_true",
                   help="decode and score each variant's own answer instead of its KL (no reference pass)")
    p.add_argument("--summary", nargs="+", help="print the tables of these output files instead of running")
    p.add_argument("--f1", nargs="+", help="print each variant's score over full recompute's from these files")
    p.add_argument("--baseline", default="cachetune", help="--summary: the variant TTFT is relative to")
    p.add_argument("--pool", action="store_true", help="--summary: all files as one sample")
    p.add_argument("--only", nargs="+", help="--summary, --f1: show these variants (and the baseline) only")
    p.add_argument("--plot", help="--summary: also draw KL against TTFT over the baseline to this PNG")
    p.add_argument("--title", help="--plot: the figure's title [KL and TTFT at r = --ratio]")
    p.add_argument("--ttft-bar", type=float, help="--plot: shade TTFT over the baseline up to this (the bar's 1.10)")
    args = p.parse_args()
    if args.f1:
        print(f1_summary(args.f1, args.ratio, args.only))
    elif args.summary:
        groups = compare(args.summary, args.baseline, args.ratio, args.pool, args.only)
        print(tables(groups))
        if args.plot:
            from bars import method_names  # a sibling script: the names scripts/selection_methods.sh gives
            names = {spec: name.lower() for name, spec in method_names().items()}
            title = args.title or f"KL and TTFT at r = {args.ratio:g}"
            print(f"wrote {plot_summary(groups, args.plot, title, args.ttft_bar, names)}")
    else:
        run(args)


if __name__ == "__main__":
    main()
