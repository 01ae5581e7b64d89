"""`eval` runs every method on datasets (quality, fidelity, TTFT; JSON, tables, plots); `bench` is the
same with three methods."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from cachetune.cli.common import datasets, engine, engine_args, floats, methods, report_out
from cachetune.config import EngineConfig


def cmd_eval(args) -> int:
    from cachetune.eval.datasets import bundled_sample_path, rechunk
    from cachetune.eval.harness import EvalConfig, config_dict, run_eval
    from cachetune.eval.report import (by_chunk_length, format_by_length, format_quality_floors, format_tables,
                                       plot_frontier, plot_quality_by_length, plot_ratio_curves, plot_tradeoff,
                                       quality_floors, summarize_records, sweep_records)

    sets = datasets(args, str(bundled_sample_path()))
    cfg = EvalConfig(methods=methods(args.methods), ratio=EngineConfig.ratio if args.ratio is None else args.ratio,
                     ratios=floats(args.ratios), sweep_examples=args.sweep_examples,
                     max_new_tokens=args.max_new_tokens, repeats=args.repeats, system=args.system,
                     retime=tuple(methods(args.retime)) if args.retime else (),
                     rerun=tuple(methods(args.rerun)) if args.rerun else ())
    eng = engine(args)
    if args.chunk_tokens:  # each set once per length, its documents cut again: "musique@128t"

        def count(text: str) -> int:
            return int(eng.template.encode(text).numel())

        sets = {f"{name}@{n}t": [rechunk(e, n, count) for e in examples]
                for name, examples in sets.items() for n in args.chunk_tokens}
    cfg = replace(cfg, ratio=eng.config.ratio)  # --ratio, else the --config file's, else the default
    skipped = {}
    if args.methods == "all":  # every registered method this engine can serve; say why for the rest
        skipped = {m: why for m in cfg.methods if (why := eng.unavailable(eng.method(m)))}
        for m, why in skipped.items():
            print(f"skipping {m}: {why}", file=sys.stderr)
        cfg = replace(cfg, methods=[m for m in cfg.methods if m not in skipped])
    progress_path = None
    if args.json:
        progress_path = Path(args.json).with_suffix(".progress.jsonl")
        if args.fresh and progress_path.exists():
            progress_path.unlink()
    records = run_eval(eng, sets, cfg, progress_path)
    labels = [v.label for v in cfg.variants()]
    report = {"model": eng.name, "dtype": eng.config.dtype, "device": str(eng.adapter.device),
              "threads": torch.get_num_threads(),
              "config": config_dict(cfg), "datasets": summarize_records(records, labels),
              "skipped": skipped, "examples": records}
    if cfg.ratios:  # the sweep on the examples that ran all of it (every one, without --sweep-examples)
        report["frontier"] = summarize_records(sweep_records(records, labels), labels)
    table = format_tables(report)
    if args.chunk_tokens:
        report["by_chunk_length"] = by_chunk_length(report)
        report["quality_floors"] = quality_floors(report)
        table += ("\n\n" + format_by_length(report["by_chunk_length"]) + "\n\n"
                  + format_quality_floors(report["quality_floors"]))
    report_out(report, table, args.json)
    if args.plots:
        sweep = {**report, "datasets": report.get("frontier", report["datasets"])}
        frontier = plot_frontier(sweep, args.plots, mark=_default_variant(eng, cfg)) if cfg.ratios else []
        for path in [*plot_tradeoff(report, args.plots), plot_ratio_curves(sweep, args.plots), *frontier,
                     plot_quality_by_length(report, args.plots)]:
            if path is not None:
                print(f"wrote {path}", file=sys.stderr)
    return 0


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, e.g. 128,256,512; got {text!r}")
    return lengths


def _default_variant(eng, cfg) -> str | None:
    """The label of the eval variant that serves exactly as the engine's default method and ratio."""
    from cachetune.methods import make_method

    default = make_method(eng.config.method, eng.config)
    for v in cfg.variants():
        m = make_method(v.method, eng.config, ratio=v.ratio)
        if m.name.partition(":")[0] == default.name.partition(":")[0] and m.settings == default.settings:
            return v.label
    return None


def _eval_args(p: argparse.ArgumentParser, default_methods: str, repeats: int) -> None:
    p.add_argument("--data", action="append",
                   help="dataset name (musique, 2wikimqa, hotpotqa, multi_news, samsum, lb_*) or file; "
                        "repeat or comma-separate for several (default: the bundled MuSiQue sample)")
    p.add_argument("--methods", default=default_methods, help="comma-separated, or 'all'")
    p.add_argument("--ratio", type=float, help=f"recompute budget of every method with one [{EngineConfig.ratio}]")
    p.add_argument("--ratios", help="comma-separated budgets: methods that use one run once per r, as name@r")
    p.add_argument("--sweep-examples", type=int, metavar="N",
                   help="with --ratios: the ratios other than --ratio only on each set's first N examples")
    p.add_argument("--limit", type=int, help="first N examples of each dataset")
    p.add_argument("--chunk-tokens", type=_lengths, metavar="N[,N...]",
                   help="cut each set's documents again into chunks of about N tokens on sentence boundaries, "
                        "each cached alone: one set per N, named set@Nt (quality by chunk length)")
    p.add_argument("--max-new-tokens", type=int, help="default: 32 for QA, 128 for summarization")
    p.add_argument("--repeats", type=int, default=repeats, help="extra timing passes per example")
    p.add_argument("--system", help="system prompt (default: per task)")
    p.add_argument("--json", help="write the report here, a .md table beside it, and resume from "
                                  "its .progress.jsonl")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) earlier progress for --json")
    p.add_argument("--retime", help="comma-separated methods already recorded for an example that run again "
                                    "when a resumed run adds others to it, so both are timed in one pass")
    p.add_argument("--rerun", help="comma-separated methods that run again on each resumed example whose record of "
                                   "them was made with other settings (a default changed), with a fresh full "
                                   "recompute timed in the same pass")
    p.add_argument("--plots", help="directory for the quality/fidelity vs TTFT PNGs")
    engine_args(p, own=("ratio", "max_new_tokens"))
    p.set_defaults(func=cmd_eval)


def add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="every method on datasets: quality, fidelity, TTFT (JSON, tables, plots)")
    _eval_args(ev, default_methods="all", repeats=0)


def add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="a quick eval: full recompute, full reuse and cachetune")
    _eval_args(bench, default_methods="full_recompute,full_reuse,cachetune", repeats=0)
