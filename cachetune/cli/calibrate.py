"""The machine's settings: `calibrate` (the recompute ratio of one tier), `calibrate-price` (deep
focus's measured price) and `bench-calibrate` (fixed against calibrated ratios per tier)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cachetune.cli.common import config, engine, engine_args, floats, report_out


def _calibration_examples(args) -> list:
    from cachetune.eval.datasets import load_dataset

    examples = load_dataset(args.data, args.limit)
    if not examples:
        raise ValueError(f"dataset {args.data!r} has no examples")
    return examples


def _calibration_config(args, min_ratio: float):
    from cachetune.tuning.calibrate import CalibrationConfig

    return CalibrationConfig(min_ratio=min_ratio, max_ratio=args.max_ratio, eps=args.eps, width=args.width,
                             repeats=args.repeats)


def _report_and_save(eng, report: dict, table: str, args, save) -> int:
    """Print and write the report; with --save, store it in the engine's calibration file via `save`."""
    report_out(report, table, args.json)
    if args.save:
        key = save(eng, report)
        print(f"saved for {key.text()} in {eng.calibration.path}", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from cachetune.config import parse_tiers
    from cachetune.eval.bench_batch import example_prompt
    from cachetune.tuning.calibrate import calibrate, save_calibration

    spec = f"{args.tier}@{args.throttle}" if args.throttle else args.tier
    if len(parse_tiers(spec)) != 1:
        raise ValueError(f"--tier names one tier, got {args.tier!r}")
    eng = engine(args, tiers=spec)
    prompts = [example_prompt(eng, ex, args.docs) for ex in _calibration_examples(args)]  # chunks in the tier
    report = calibrate(eng, prompts, _calibration_config(args, eng.config.min_ratio))
    report["data"] = args.data
    probes = ", ".join(f"{p['ratio']:.3f}: {p['ttft_s'] * 1000:.0f} ms" for p in report["probes"])
    table = (f"tier {report['tier']}: calibrated r = {report['ratio']:.3f} (warm start {report['warm_start']:.3f}, "
             f"r_min {report['config']['min_ratio']:g}; {len(report['probes'])} probes in {report['seconds']:.0f} s)\n"
             f"probes (r: mean TTFT): {probes}")
    return _report_and_save(eng, report, table, args, save_calibration)


def cmd_calibrate_price(args) -> int:
    from cachetune.eval.bench_batch import example_prompt
    from cachetune.tuning.price import format_price, measure_price, save_price

    eng = engine(args)
    prompts = [example_prompt(eng, ex, args.docs) for ex in _calibration_examples(args)]
    report = measure_price(eng, prompts, eng.config.ratio, args.repeats)
    report["data"] = args.data
    return _report_and_save(eng, report, format_price(report), args, save_price)


def cmd_bench_calibrate(args) -> int:
    from cachetune.eval.bench_calibrate import CalibrationBenchConfig, format_table, plot_sweeps, run_bench_calibrate
    from cachetune.model.loader import load_model

    cfg_engine = config(args)
    if cfg_engine.threads:
        torch.set_num_threads(cfg_engine.threads)
    cfg = CalibrationBenchConfig(tiers=tuple(t.strip() for t in args.bench_tiers.split(",") if t.strip()),
                                 sweep=floats(args.sweep), repeats=args.sweep_repeats,
                                 calibration=_calibration_config(args, cfg_engine.min_ratio))
    examples = _calibration_examples(args)
    progress_file = Path(args.json).with_suffix(".progress.jsonl") if args.json else None  # a rerun resumes
    report = run_bench_calibrate(load_model(cfg_engine.model, dtype=cfg_engine.torch_dtype), cfg_engine, examples,
                                 cfg, args.docs, progress_file=progress_file)
    report["data"] = args.data
    report_out(report, format_table(report), args.json, plot_sweeps)
    return 0


def _calibration_args(p: argparse.ArgumentParser, limit: int) -> None:
    from cachetune.tuning.calibrate import CalibrationConfig as C

    p.add_argument("--data", default="musique", help="calibration prompts: dataset name or file (no answers "
                                                     "are used) [%(default)s]")
    p.add_argument("--limit", type=int, default=limit, help="prompts [%(default)s]")
    p.add_argument("--docs", type=int, default=0, help="documents per prompt (0: all) [%(default)s]")
    p.add_argument("--repeats", type=int, default=C.repeats, help="timed prefills per prompt and probe [%(default)s]")
    p.add_argument("--eps", type=float, default=C.eps, help="the search's ratio tolerance [%(default)s]")
    p.add_argument("--width", type=float, default=C.width, help="the search's first bracket, around the cost "
                                                                "model's optimum [%(default)s]")
    p.add_argument("--max-ratio", type=float, default=C.max_ratio, help="[%(default)s]; the floor is --min-ratio")
    p.add_argument("--json", help="write the report here (a .md beside it)")


def add_calibrate(sub) -> None:
    cal = sub.add_parser("calibrate", help="choose the recompute ratio for one tier on this machine (profile, "
                                           "cost model, golden-section search); ratio \"auto\" uses it")
    cal.add_argument("--tier", default="cpu", help="the tier, as in --tiers: cpu, disk, disk:/path, "
                                                   "redis://host:port [%(default)s]")
    cal.add_argument("--throttle", help="read the tier at a slower medium's pace: hdd, ssd, nvme, or e.g. "
                                        "60MB/s+5ms (the same as --tier TIER@MEDIUM)")
    cal.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                     help="store the ratio in the calibration file (--calibration) [on]")
    _calibration_args(cal, limit=4)
    engine_args(cal, own=("tiers",))
    cal.set_defaults(func=cmd_calibrate)


def add_calibrate_price(sub) -> None:
    from cachetune.tuning.price import REPEATS

    cp = sub.add_parser("calibrate-price", help="measure deep focus's price over first on this machine, which "
                                                "the deep_within setting scales its predictions by")
    cp.add_argument("--data", default="musique", help="prompts: dataset name or file (no answers are used) "
                                                      "[%(default)s]")
    cp.add_argument("--limit", type=int, default=4, help="prompts [%(default)s]")
    cp.add_argument("--docs", type=int, default=0, help="documents per prompt (0: all) [%(default)s]")
    cp.add_argument("--repeats", type=int, default=REPEATS, help="timed prefills per prompt and method "
                                                                  "[%(default)s]")
    cp.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                    help="store the scale in the calibration file (--calibration) [on]")
    cp.add_argument("--json", help="write the report here (a .md beside it)")
    engine_args(cp)
    cp.set_defaults(func=cmd_calibrate_price)


def add_bench_calibrate(sub) -> None:
    from cachetune.eval.bench_calibrate import DEFAULT_TIERS, CalibrationBenchConfig as CB

    bc = sub.add_parser("bench-calibrate", help="fixed against calibrated r per tier, the cost model against "
                                                "measurement (paper Table 5, Figure 10)")
    bc.add_argument("--tiers", dest="bench_tiers", default=",".join(DEFAULT_TIERS),
                    help="comma-separated single tiers (slow: a disk throttled below the crossover) [%(default)s]")
    bc.add_argument("--sweep", default=",".join(f"{r:g}" for r in CB.sweep), help="ratios timed [%(default)s]")
    bc.add_argument("--sweep-repeats", type=int, default=CB.repeats,
                    help="timed runs per prompt of every sweep ratio and of the comparison [%(default)s]")
    _calibration_args(bc, limit=3)
    engine_args(bc, own=("tiers",))
    bc.set_defaults(func=cmd_bench_calibrate)
