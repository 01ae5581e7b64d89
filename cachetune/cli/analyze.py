"""`analyze`: the paper's analyses (drift recall, spectrum, attention, r/alpha sweeps, robustness)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cachetune.cli.common import datasets, engine, engine_args, floats
from cachetune.config import EngineConfig

ANALYSES = ("drift", "spectrum", "attention", "sweep", "robustness")


def cmd_analyze(args) -> int:
    from cachetune.eval import analyses, drift, spectrum
    from cachetune.eval.harness import EvalConfig, config_dict, run_eval
    from cachetune.eval.report import format_tables, summarize_records, write_json

    sets = datasets(args, "musique")
    eng = engine(args)
    args.ratio, args.alpha = eng.config.ratio, eng.config.alpha  # flag, else --config, else default
    out = Path(args.out)
    stem = out / f"{args.analysis}"
    if args.analysis in ("drift", "spectrum", "attention"):
        examples = [ex for exs in sets.values() for ex in exs]
        if args.analysis == "drift":
            rankers = tuple(args.rankers.split(",")) if args.rankers else drift.DriftConfig.rankers
            config = drift.DriftConfig(ratio=args.ratio, alpha=args.alpha, rankers=rankers, ratios=floats(args.ratios))
            report = drift.run_drift_recall(eng, examples, config)
            table, plot = drift.format_drift_table(report), drift.plot_drift
        elif args.analysis == "spectrum":
            report = spectrum.run_spectrum(eng, examples)
            table, plot = spectrum.format_spectrum_table(report), spectrum.plot_spectrum
        else:
            report = analyses.attention_similarity(eng, examples, ratio=args.ratio)
            table, plot = analyses.format_attention_table(report), analyses.plot_attention
        report["datasets"] = list(sets)
    else:
        cfg = EvalConfig(methods=["full_recompute"], ratio=args.ratio, max_new_tokens=args.max_new_tokens)
        if args.analysis == "sweep":
            variants, settings, plot = analyses.sweep_variants(), (analyses.Setting(),), analyses.plot_sweep
        else:
            rankers = args.rankers.split(",") if args.rankers else analyses.ROBUSTNESS_RANKERS
            variants, settings = analyses.robustness_variants(args.ratio, rankers), analyses.ROBUSTNESS_SETTINGS
            plot = analyses.plot_robustness
        records = run_eval(eng, sets, cfg, stem.with_suffix(".progress.jsonl"), variants=variants,
                           settings=settings)
        labels = [v.label for v in variants]
        report = {"model": eng.name, "dtype": eng.config.dtype, "threads": torch.get_num_threads(),
                  "config": config_dict(cfg), "datasets": summarize_records(records, labels), "examples": records}
        table = format_tables(report)
    print(table)
    write_json(report, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(table + "\n")
    plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md, .png", file=sys.stderr)
    return 0


def add_analyze(sub) -> None:
    an = sub.add_parser("analyze", help="the paper's analyses: drift recall, spectrum, attention, sweeps, robustness")
    an.add_argument("analysis", choices=ANALYSES)
    an.add_argument("--data", action="append", help="dataset names or files (default: musique)")
    an.add_argument("--limit", type=int, default=10, help="first N examples of each dataset (default 10)")
    an.add_argument("--ratio", type=float, help=f"recompute budget [{EngineConfig.ratio}]")
    an.add_argument("--alpha", type=float, help=f"low-frequency share of the lf ranking [{EngineConfig.alpha}]")
    an.add_argument("--rankers", help="drift / robustness: comma-separated offline rankers to compare")
    an.add_argument("--ratios", help="drift: more ratios to report Recall@r at, comma-separated")
    an.add_argument("--max-new-tokens", type=int, help="sweep / robustness: default per task")
    an.add_argument("--out", default="results/analysis", help="writes <analysis>.json, .md and .png here")
    engine_args(an, own=("ratio", "alpha", "max_new_tokens"))
    an.set_defaults(func=cmd_analyze)
