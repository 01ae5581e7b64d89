"""Command line: `ask` answers over documents, `serve` runs the HTTP server, `eval` / `bench` compare
methods, `bench-batch` measures concurrent serving, `bench-serve` a running server, `analyze` probes. Every command that runs the engine takes one flag per
EngineConfig field (derived from the dataclass, so a new setting is a new flag) plus `--config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from dataclasses import replace
from pathlib import Path

import torch

from cachetune.config import ALLOCATIONS, DTYPES, SIGNALS, EngineConfig, byte_size

CHOICES = {"dtype": sorted(DTYPES), "allocation": ALLOCATIONS, "signal": SIGNALS}


def _flag_type(annotation) -> type:
    """The one non-None type of a field's annotation (str, int, float or bool)."""
    args = [a for a in typing.get_args(annotation) or (annotation,) if a is not type(None)]
    return args[0]


def _engine_args(p: argparse.ArgumentParser, own: tuple[str, ...] = ()) -> None:
    """--config plus one flag per EngineConfig field, except `own` fields the command defines itself
    (their values still reach the config)."""
    p.add_argument("--config", help="EngineConfig as .json or .toml; the flags below override it")
    _field_args(p, EngineConfig, "engine", own)


def _field_args(p: argparse.ArgumentParser, cls, title: str, own: tuple[str, ...] = ()) -> None:
    """One flag per field of the config dataclass `cls` (help from its comments)."""
    group = p.add_argument_group(title, f"{cls.__name__} fields (defaults in brackets)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in own:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{cls.help(f.name)} [{f.default}]"
        kind = _flag_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name.endswith("_bytes"):
            group.add_argument(flag, dest=f.name, type=byte_size, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, choices=CHOICES.get(f.name), help=help_text)


def _config(args, **fixed) -> EngineConfig:
    """The EngineConfig of the flags (over --config's file); `fixed` fields win over both."""
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)} | fixed
    if args.config:
        return EngineConfig.from_file(args.config, **overrides)
    return EngineConfig(**{k: v for k, v in overrides.items() if v is not None})


def _engine(args, **fixed):
    from cachetune.engine.engine import Engine

    engine = Engine.from_pretrained(config=_config(args, **fixed))
    if engine.reuse_error:
        print(f"warning: {engine.reuse_error}", file=sys.stderr)
    return engine


def cmd_ask(args) -> int:
    from cachetune.engine.calibration import AUTO
    from cachetune.runtime.decode import SamplingConfig

    engine = _engine(args, ratio=None if args.ratio == AUTO else args.ratio)  # "auto" is per request
    ids = [engine.cache_chunk(Path(doc).read_text() + "\n\n") for doc in args.doc]
    sampling = SamplingConfig(args.max_new_tokens or engine.config.max_new_tokens, args.temperature, args.top_p,
                              args.seed)
    out = engine.generate(ids, args.question, args.system, args.method, args.ratio, sampling)
    print(out.text)
    print(f"[{out.method} r={out.ratio:.3g}] TTFT {out.ttft_ms:.0f} ms, prompt {out.prompt_tokens} tokens, "
          f"recomputed {out.recomputed_tokens} chunk tokens", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from cachetune.config import ServerConfig
    from cachetune.server.app import serve

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if getattr(args, f.name) is not None}
    if "api_key" not in fields and os.environ.get("CACHETUNE_API_KEY"):  # kept out of `ps` listings
        fields["api_key"] = os.environ["CACHETUNE_API_KEY"]
    if args.ratio is not None:
        fields.setdefault("auto_ratio", False)  # a ratio asked for on the command line is the default
    server = ServerConfig(**fields)
    serve(_engine(args), server, log_level=args.log_level)
    return 0


def cmd_bench_serve(args) -> int:
    from cachetune.eval.bench_serve import (ServeBenchConfig, format_table, rescore, run_bench_serve,
                                            wait_until_healthy, write_report)

    if args.rescore:  # a saved report judged again (e.g. by another --min-rate-share)
        report = json.loads(Path(args.rescore).read_text())
        report["config"]["min_rate_share"] = args.min_rate_share
        report = rescore(report)
        print(format_table(report))
        for path in write_report(report, Path(args.rescore).parent):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    config = ServeBenchConfig(url=args.url, methods=methods, rates=_floats(args.rates),
                              requests_per_rate=args.requests_per_rate, max_seconds_per_rate=args.max_seconds,
                              slo_ms=args.slo_ms, slo_percentile=args.slo_percentile, max_tokens=args.max_tokens,
                              data=args.data, docs_per_prompt=args.docs, prompts=args.prompts, seed=args.seed,
                              api_key=args.api_key, ratio=args.ratio, min_rate_share=args.min_rate_share)
    if args.wait:
        wait_until_healthy(config.url, args.wait)
    report = run_bench_serve(config)
    print(format_table(report))
    for path in write_report(report, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _methods(text: str) -> list[str]:
    from cachetune.methods import method_names

    return method_names() if text == "all" else [m.strip() for m in text.split(",") if m.strip()]


def _ratio(text: str) -> float | str:
    """A --ratio value: a number in [0, 1], or "auto" (the calibrated ratio of the chunks' tier)."""
    from cachetune.engine.calibration import AUTO

    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'not a ratio: {text!r} (a number in [0, 1] or "auto")') from None


def _floats(text: str | None) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip()) if text else ()


def _datasets(args, default: str) -> dict:
    """--data values (names or files, repeated or comma-separated) -> {name or file stem: examples}.

    Names are unique: a file whose stem is taken already (a/musique.json, then b/musique.json) is
    named with its parent folders as needed ("b/musique"), and as a last resort numbered ("musique#2").
    A dataset without examples (an empty file, --limit 0) is a ValueError."""
    from cachetune.eval.datasets import DATASETS, load_dataset

    specs = [d for arg in (args.data or [default]) for d in arg.split(",") if d]
    out: dict = {}
    for spec in specs:
        examples = load_dataset(spec, args.limit)  # first: a missing file fails here, with its own message
        if spec in DATASETS:
            candidates = [spec]
        else:  # "stem", "parent/stem", "grandparent/parent/stem", ...
            path = Path(spec)
            folders = path.parent.parts[1:] if path.anchor else path.parent.parts
            parts = [p for p in folders if p != "."] + [path.stem]
            candidates = ["/".join(parts[-n:]) for n in range(1, len(parts) + 1)]
        name = next((c for c in candidates if c not in out), None)
        n = 2
        while name is None or name in out:  # the same file twice
            name, n = f"{candidates[0]}#{n}", n + 1
        if not examples:
            limit = f" with --limit {args.limit}" if args.limit is not None else ""
            raise ValueError(f"dataset {name!r} ({spec}) has no examples{limit}")
        out[name] = examples
    return out


def _report_out(report: dict, table: str, json_path: str | None) -> None:
    """Print the table; with a path, write the report there as JSON and the table beside it (.md)."""
    from cachetune.eval.report import write_json

    print(table)
    if json_path:
        write_json(report, json_path)
        Path(json_path).with_suffix(".md").write_text(table + "\n")
        print(f"wrote {json_path}", file=sys.stderr)


def cmd_eval(args) -> int:
    from cachetune.eval.datasets import bundled_sample_path
    from cachetune.eval.harness import EvalConfig, config_dict, run_eval
    from cachetune.eval.report import (format_tables, plot_frontier, plot_ratio_curves, plot_tradeoff,
                                       summarize_records, sweep_records)

    datasets = _datasets(args, str(bundled_sample_path()))
    cfg = EvalConfig(methods=_methods(args.methods), ratio=EngineConfig.ratio if args.ratio is None else args.ratio,
                     ratios=_floats(args.ratios), sweep_examples=args.sweep_examples,
                     max_new_tokens=args.max_new_tokens, repeats=args.repeats, system=args.system,
                     retime=tuple(_methods(args.retime)) if args.retime else ())
    engine = _engine(args)
    cfg = replace(cfg, ratio=engine.config.ratio)  # --ratio, else the --config file's, else the default
    skipped = {}
    if args.methods == "all":  # every registered method this engine can serve; say why for the rest
        skipped = {m: why for m in cfg.methods if (why := engine.method(m).unavailable(engine.context))}
        for m, why in skipped.items():
            print(f"skipping {m}: {why}", file=sys.stderr)
        cfg = replace(cfg, methods=[m for m in cfg.methods if m not in skipped])
    progress_path = None
    if args.json:
        progress_path = Path(args.json).with_suffix(".progress.jsonl")
        if args.fresh and progress_path.exists():
            progress_path.unlink()
    records = run_eval(engine, datasets, cfg, progress_path)
    labels = [v.label for v in cfg.variants()]
    report = {"model": engine.name, "dtype": engine.config.dtype, "device": str(engine.adapter.device),
              "threads": torch.get_num_threads(),
              "config": config_dict(cfg), "datasets": summarize_records(records, labels),
              "skipped": skipped, "examples": records}
    if cfg.ratios:  # the sweep on the examples that ran all of it (every one, without --sweep-examples)
        report["frontier"] = summarize_records(sweep_records(records, labels), labels)
    _report_out(report, format_tables(report), args.json)
    if args.plots:
        sweep = {**report, "datasets": report.get("frontier", report["datasets"])}
        frontier = plot_frontier(sweep, args.plots, mark=_default_variant(engine, cfg)) if cfg.ratios else []
        for path in [*plot_tradeoff(report, args.plots), plot_ratio_curves(sweep, args.plots), *frontier]:
            if path is not None:
                print(f"wrote {path}", file=sys.stderr)
    return 0


def _default_variant(engine, cfg) -> str | None:
    """The label of the eval variant that serves exactly as the engine's default method and ratio."""
    from cachetune.methods import make_method

    default = make_method(engine.config.method, engine.config)
    for v in cfg.variants():
        m = make_method(v.method, engine.config, ratio=v.ratio)
        if m.name.partition(":")[0] == default.name.partition(":")[0] and m.settings == default.settings:
            return v.label
    return None


def _eval_args(p: argparse.ArgumentParser, methods: str, repeats: int) -> None:
    p.add_argument("--data", action="append",
                   help="dataset name (musique, 2wikimqa, hotpotqa, multi_news, samsum, lb_*) or file; "
                        "repeat or comma-separate for several (default: the bundled MuSiQue sample)")
    p.add_argument("--methods", default=methods, help="comma-separated, or 'all'")
    p.add_argument("--ratio", type=float, help=f"recompute budget of every method with one [{EngineConfig.ratio}]")
    p.add_argument("--ratios", help="comma-separated budgets: methods that use one run once per r, as name@r")
    p.add_argument("--sweep-examples", type=int, metavar="N",
                   help="with --ratios: the ratios other than --ratio only on each set's first N examples")
    p.add_argument("--limit", type=int, help="first N examples of each dataset")
    p.add_argument("--max-new-tokens", type=int, help="default: 32 for QA, 128 for summarization")
    p.add_argument("--repeats", type=int, default=repeats, help="extra timing passes per example")
    p.add_argument("--system", help="system prompt (default: per task)")
    p.add_argument("--json", help="write the report here, a .md table beside it, and resume from "
                                  "its .progress.jsonl")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) earlier progress for --json")
    p.add_argument("--retime", help="comma-separated methods already recorded for an example that run again "
                                    "when a resumed run adds others to it, so both are timed in one pass")
    p.add_argument("--plots", help="directory for the quality/fidelity vs TTFT PNGs")
    _engine_args(p, own=("ratio", "max_new_tokens"))
    p.set_defaults(func=cmd_eval)


ANALYSES = ("drift", "spectrum", "attention", "sweep", "robustness")


def cmd_analyze(args) -> int:
    from cachetune.eval import analyses, drift, spectrum
    from cachetune.eval.harness import EvalConfig, config_dict, run_eval
    from cachetune.eval.report import format_tables, summarize_records, write_json

    datasets = _datasets(args, "musique")
    engine = _engine(args)
    args.ratio, args.alpha = engine.config.ratio, engine.config.alpha  # flag, else --config, else default
    out = Path(args.out)
    stem = out / f"{args.analysis}"
    if args.analysis in ("drift", "spectrum", "attention"):
        examples = [ex for exs in datasets.values() for ex in exs]
        if args.analysis == "drift":
            rankers = tuple(args.rankers.split(",")) if args.rankers else drift.DriftConfig.rankers
            config = drift.DriftConfig(ratio=args.ratio, alpha=args.alpha, rankers=rankers, ratios=_floats(args.ratios))
            report = drift.run_drift_recall(engine, examples, config)
            table, plot = drift.format_drift_table(report), drift.plot_drift
        elif args.analysis == "spectrum":
            report = spectrum.run_spectrum(engine, examples)
            table, plot = spectrum.format_spectrum_table(report), spectrum.plot_spectrum
        else:
            report = analyses.attention_similarity(engine, examples, ratio=args.ratio)
            table, plot = analyses.format_attention_table(report), analyses.plot_attention
        report["datasets"] = list(datasets)
    else:
        cfg = EvalConfig(methods=["full_recompute"], ratio=args.ratio, max_new_tokens=args.max_new_tokens)
        if args.analysis == "sweep":
            variants, settings, plot = analyses.sweep_variants(), (analyses.Setting(),), analyses.plot_sweep
        else:
            rankers = args.rankers.split(",") if args.rankers else analyses.ROBUSTNESS_RANKERS
            variants, settings = analyses.robustness_variants(args.ratio, rankers), analyses.ROBUSTNESS_SETTINGS
            plot = analyses.plot_robustness
        records = run_eval(engine, datasets, cfg, stem.with_suffix(".progress.jsonl"), variants=variants,
                           settings=settings)
        labels = [v.label for v in variants]
        report = {"model": engine.name, "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
                  "config": config_dict(cfg), "datasets": summarize_records(records, labels), "examples": records}
        table = format_tables(report)
    print(table)
    write_json(report, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(table + "\n")
    plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md, .png", file=sys.stderr)
    return 0


# bench-batch admits every request of a level in its first step (so c requests really decode together)
# and gives the KV room for 16 long prompts, unless --prefill-tokens-per-step / --kv-budget-bytes say otherwise.
BATCH_BENCH_ENGINE = {"prefill_tokens_per_step": 10**9, "kv_budget_bytes": 16 * 2**30}


def cmd_bench_batch(args) -> int:
    from cachetune.eval.bench_batch import BatchBenchConfig, format_batch_table, plot_batch, run_bench_batch
    from cachetune.eval.datasets import load_dataset

    levels = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    cfg = BatchBenchConfig(concurrency=levels, max_new_tokens=args.max_new_tokens or 32, method=args.method,
                           ratio=args.ratio, sizes={"short": args.short_docs, "long": args.long_docs},
                           repeats=args.repeats, hf_baseline=args.hf_baseline)
    sets = {name: load_dataset(spec, max(levels)) for name, spec in (("short", args.short), ("long", args.long))
            if spec}
    if not sets:
        raise ValueError("nothing to run: give --short and/or --long")
    for key, value in BATCH_BENCH_ENGINE.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    engine = _engine(args)
    report = run_bench_batch(engine, sets, cfg)
    report["data"] = {name: spec for name, spec in (("short", args.short), ("long", args.long)) if spec}
    _report_out(report, format_batch_table(report), args.json)
    if args.json:
        plot = plot_batch(report, Path(args.json).with_suffix(".png"))
        print(f"wrote {plot}", file=sys.stderr)
    return 0 if all(r["tokens_equal_alone"] for r in report["rows"]) else 1


def cmd_bench_pipeline(args) -> int:
    from cachetune.eval.bench_pipeline import (TIERS, PipelineBenchConfig, format_pipeline_table,
                                               format_summary_table, plot_pipeline, run_bench_pipeline)
    from cachetune.eval.datasets import load_dataset

    if args.combine:  # the reports of earlier runs in one table and one plot
        folder = Path(args.combine)
        reports = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.stem != "all"]
        order = {tier: i for i, tier in enumerate(TIERS)}
        reports.sort(key=lambda r: order[r["config"]["tier"]])
        _report_out({"reports": reports}, format_summary_table(reports), str(folder / "all.json"))
        print(f"wrote {plot_pipeline(reports, folder / 'all.png')}", file=sys.stderr)
        return 0
    cfg = PipelineBenchConfig(tier=args.tier, ratio=EngineConfig.ratio if args.ratio is None else args.ratio,
                              repeats=args.repeats, documents=args.docs, disk_dir=args.dir, redis_url=args.redis_url)
    examples = load_dataset(args.data, args.limit)
    report = run_bench_pipeline(_engine(args), examples, cfg)
    report["data"] = args.data
    _report_out(report, format_pipeline_table(report), args.json)
    if args.json:
        print(f"wrote {plot_pipeline([report], Path(args.json).with_suffix('.png'))}", file=sys.stderr)
    return 0


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


def cmd_calibrate(args) -> int:
    from cachetune.config import parse_tiers
    from cachetune.eval.bench_batch import example_prompt
    from cachetune.tuning.calibrate import calibrate, save_calibration

    spec = f"{args.tier}@{args.throttle}" if args.throttle else args.tier
    if len(parse_tiers(spec)) != 1:
        raise ValueError(f"--tier names one tier, got {args.tier!r}")
    engine = _engine(args, tiers=spec)
    prompts = [example_prompt(engine, ex, args.docs) for ex in _calibration_examples(args)]  # chunks in the tier
    report = calibrate(engine, prompts, _calibration_config(args, engine.config.min_ratio))
    report["data"] = args.data
    probes = ", ".join(f"{p['ratio']:.3f}: {p['ttft_s'] * 1000:.0f} ms" for p in report["probes"])
    table = (f"tier {report['tier']}: calibrated r = {report['ratio']:.3f} (warm start {report['warm_start']:.3f}, "
             f"r_min {report['config']['min_ratio']:g}; {len(report['probes'])} probes in {report['seconds']:.0f} s)\n"
             f"probes (r: mean TTFT): {probes}")
    _report_out(report, table, args.json)
    if args.save:
        key = save_calibration(engine, report)
        print(f"saved for {key.text()} in {engine.calibration.path}", file=sys.stderr)
    return 0


def cmd_calibrate_price(args) -> int:
    from cachetune.eval.bench_batch import example_prompt
    from cachetune.tuning.price import format_price, measure_price, save_price

    engine = _engine(args)
    prompts = [example_prompt(engine, ex, args.docs) for ex in _calibration_examples(args)]
    report = measure_price(engine, prompts, engine.config.ratio, args.repeats)
    report["data"] = args.data
    _report_out(report, format_price(report), args.json)
    if args.save:
        key = save_price(engine, report)
        print(f"saved for {key.text()} in {engine.calibration.path}", file=sys.stderr)
    return 0


def cmd_bench_calibrate(args) -> int:
    from cachetune.eval.bench_calibrate import CalibrationBenchConfig, format_table, plot_sweeps, run_bench_calibrate
    from cachetune.model.loader import load_model

    config = _config(args)
    if config.threads:
        torch.set_num_threads(config.threads)
    cfg = CalibrationBenchConfig(tiers=tuple(t.strip() for t in args.bench_tiers.split(",") if t.strip()),
                                 sweep=_floats(args.sweep), repeats=args.sweep_repeats,
                                 calibration=_calibration_config(args, config.min_ratio))
    examples = _calibration_examples(args)
    progress_file = Path(args.json).with_suffix(".progress.jsonl") if args.json else None  # a rerun resumes
    report = run_bench_calibrate(load_model(config.model, dtype=config.torch_dtype), config, examples, cfg, args.docs,
                                 progress_file=progress_file)
    report["data"] = args.data
    _report_out(report, format_table(report), args.json)
    if args.json:
        print(f"wrote {plot_sweeps(report, Path(args.json).with_suffix('.png'))}", file=sys.stderr)
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


def cmd_train(args) -> int:
    """`cachetune {c2kv,kvlink,block-attention} train`: one loop, three kinds of trained add-ons."""
    from cachetune.blockattn.model import BlockAttentionConfig, BlockAttentionModel
    from cachetune.c2kv.extractor import C2Extractor, ExtractorConfig
    from cachetune.kvlink.links import LinkConfig, LinkTokens
    from cachetune.train.loop import STATE, WEIGHTS, config_from, loss_label, plot_history
    from cachetune.train.run import train_tokens

    cfg = config_from(vars(args))
    if args.command == "c2kv":
        kind, config = C2Extractor, ExtractorConfig(residual=args.residual, anchor=args.anchor,
                                                    lora_rank=args.lora_rank)
    elif args.command == "kvlink":
        kind, config = LinkTokens, LinkConfig(count=args.links)
    else:
        kind, config = BlockAttentionModel, BlockAttentionConfig(lora_rank=args.lora_rank)
    engine = _engine(args)
    state = train_tokens(engine, args.out, cfg, kind, config, args.heldout, args.split_seed, args.max_steps)
    curve = plot_history(json.loads((Path(args.out) / STATE).read_text())["history"], Path(args.out) / "curve.png",
                         f"{kind.VARIANT} training, {engine.name}", loss_label(cfg))
    print(f"wrote {curve}", file=sys.stderr)
    print(f"step {state['step']}/{cfg.steps} ({'done' if state['done'] else 'stopped; run again to resume'}), "
          f"held-out loss {state['heldout']:.4f}, {state['elapsed_s'] / 60:.1f} min in all; "
          f"weights: {Path(args.out) / WEIGHTS}")
    return 0


def cmd_c2kv_eval(args) -> int:
    from cachetune.eval import c2kv_eval
    from cachetune.eval.harness import EvalConfig, Setting, config_dict, run_eval
    from cachetune.eval.report import plot_tradeoff, summarize_records

    specs = [d for arg in (args.data or ["heldout"]) for d in arg.split(",") if d]
    datasets = {}
    if "heldout" in specs:
        datasets["heldout"] = c2kv_eval.heldout_examples(args.limit)
    rest = [d for d in specs if d != "heldout"]
    if rest:
        args.data = rest
        datasets.update(_datasets(args, "musique"))
    cfg = EvalConfig(methods=_methods(args.methods), ratio=EngineConfig.ratio if args.ratio is None else args.ratio,
                     max_new_tokens=args.max_new_tokens, system=args.system, gold_nll=True)
    engine = _engine(args)
    cfg = replace(cfg, ratio=engine.config.ratio)
    settings = (Setting(),) + ((Setting(c2kv_eval.SHUFFLED, shuffle=True),) if args.composition else ())
    progress_path = Path(args.json).with_suffix(".progress.jsonl") if args.json else None
    if args.fresh and progress_path is not None and progress_path.exists():
        progress_path.unlink()
    records = run_eval(engine, datasets, cfg, progress_path, settings=settings)
    labels = [v.label for v in cfg.variants()]
    # Storage is sized for the first C2KV method's extractor, over the first examples' documents.
    c2 = next((engine.method(m).settings.extractor for m in cfg.methods if m.split(":")[0] == "c2kv"), None)
    first = next(iter(datasets.values()))[: args.storage_examples]
    storage = c2kv_eval.stored_bytes_per_token(engine, first, c2) if c2 is not None else None
    report = {"model": engine.name, "dtype": engine.config.dtype, "device": str(engine.adapter.device),
              "threads": torch.get_num_threads(), "extractor": c2, "config": config_dict(cfg), "storage": storage,
              "datasets": summarize_records(records, labels), "examples": records}
    _report_out(report, c2kv_eval.format_c2kv_tables(report), args.json)
    if args.plots:
        for path in plot_tradeoff(report, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    """`cachetune {c2kv,kvlink,block-attention} export`: a trained file in the shipped dtype."""
    from cachetune.blockattn.model import BlockAttentionModel
    from cachetune.c2kv.extractor import C2Extractor
    from cachetune.c2kv.tokens import export_tokens
    from cachetune.kvlink.links import LinkTokens

    kind = {"c2kv": C2Extractor, "kvlink": LinkTokens, "block-attention": BlockAttentionModel}[args.command]
    path = export_tokens(args.src, args.dst, kind.FORMAT, DTYPES[args.dtype], {"exported_from": str(args.src)})
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _train_args(p: argparse.ArgumentParser) -> None:
    from cachetune.train.data import HELDOUT, SPLIT_SEED
    from cachetune.train.loop import TrainConfig

    p.add_argument("--out", required=True, help="run folder: checkpoint, state and weights (resumes from it)")
    p.add_argument("--heldout", type=int, help=f"held-out HotpotQA rows training never sees [{HELDOUT}]")
    p.add_argument("--split-seed", type=int, help=f"seed of the held-out permutation [{SPLIT_SEED}]")
    p.add_argument("--max-steps", type=int, help="stop (checkpointed) after this many steps in this call; the "
                                                 "schedule still plans --steps, and a later call continues")
    hints = typing.get_type_hints(TrainConfig)
    group = p.add_argument_group("training", "TrainConfig fields (defaults in brackets)")
    for f in dataclasses.fields(TrainConfig):
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_flag_type(hints[f.name]),
                           help=f"[{f.default}]")


def _export_args(sub, name: str) -> None:
    ex = sub.add_parser("export", help="copy trained weights in another dtype (what is shipped)")
    ex.add_argument("src", help=f"a weights.safetensors of `cachetune {name} train`")
    ex.add_argument("dst", help="where to write it (files in cachetune/c2kv/weights/ are what 'bundled' finds)")
    ex.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ex.set_defaults(func=cmd_export)


def c2kv_default_methods() -> str:
    from cachetune.eval.c2kv_eval import DEFAULT_METHODS

    return DEFAULT_METHODS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer a question over documents, reusing their cached KV")
    ask.add_argument("--doc", action="append", required=True, help="a text file; repeat for several chunks")
    ask.add_argument("--question", required=True)
    ask.add_argument("--system", help="system prompt (default: answer briefly from the passages)")
    ask.add_argument("--method", help=f"registered method or cachetune:<ranking> [{EngineConfig.method}]")
    ask.add_argument("--ratio", type=_ratio, help=f"share of chunk tokens recomputed, or \"auto\": the one "
                                                  f"calibrated for the chunks' tier [{EngineConfig.ratio}]")
    ask.add_argument("--max-new-tokens", type=int, help=f"[{EngineConfig.max_new_tokens}]")
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--seed", type=int)
    _engine_args(ask, own=("method", "ratio", "max_new_tokens"))
    ask.set_defaults(func=cmd_ask)

    ev = sub.add_parser("eval", help="every method on datasets: quality, fidelity, TTFT (JSON, tables, plots)")
    _eval_args(ev, methods="all", repeats=0)
    bench = sub.add_parser("bench", help="a quick eval: full recompute, full reuse and cachetune")
    _eval_args(bench, methods="full_recompute,full_reuse,cachetune", repeats=0)
    bb = sub.add_parser("bench-batch", help="decode tokens/s and TTFT at several concurrency levels (step loop)")
    bb.add_argument("--short", default="2wikimqa", help="dataset of the short prompts ('' to skip) [2wikimqa]")
    bb.add_argument("--long", default="musique", help="dataset of the long prompts ('' to skip) [musique]")
    bb.add_argument("--short-docs", type=int, default=2,
                    help="documents per short prompt (0: all) [2: about 1.4K tokens, HotpotQA-size]")
    bb.add_argument("--long-docs", type=int, default=0, help="documents per long prompt (0: all)")
    bb.add_argument("--concurrency", default="1,4,8,16", help="comma-separated request counts [1,4,8,16]")
    bb.add_argument("--max-new-tokens", type=int, help="tokens each request decodes (EOS ignored) [32]")
    bb.add_argument("--method", help=f"prefill method of every request [{EngineConfig.method}]")
    bb.add_argument("--ratio", type=float, help=f"its recompute budget [{EngineConfig.ratio}]")
    bb.add_argument("--repeats", type=int, default=3, help="interleaved passes over the levels [3]")
    bb.add_argument("--hf-baseline", action="store_true",
                    help="also time transformers' own batched decode of the same prompts at every level")
    bb.add_argument("--json", help="write the report here, a .md table and a .png plot beside it")
    _engine_args(bb, own=("method", "ratio", "max_new_tokens"))
    bb.set_defaults(func=cmd_bench_batch)

    bp = sub.add_parser("bench-pipeline", help="the cache-loading ablation (paper Table 4) on one tier")
    bp.add_argument("--tier", default="cpu", choices=("cpu", "disk", "redis", "hdd", "ssd", "nvme", "matched"),
                    help="where the chunks are read from; hdd/ssd/nvme throttle the cpu tier to those media, "
                         "matched to a bandwidth at which loading takes as long as recompute [cpu]")
    bp.add_argument("--data", default="musique", help="dataset name or file [musique]")
    bp.add_argument("--limit", type=int, default=4, help="prompts [4]")
    bp.add_argument("--docs", type=int, default=0, help="documents per prompt (0: all)")
    bp.add_argument("--ratio", type=float, help=f"share of every chunk recomputed [{EngineConfig.ratio}]")
    bp.add_argument("--repeats", type=int, default=3, help="timed runs per variant and prompt [3]")
    bp.add_argument("--dir", help="the disk tier's folder [a temporary one]")
    bp.add_argument("--redis-url", default="redis://127.0.0.1:6379", help="the redis tier's server [%(default)s]")
    bp.add_argument("--json", help="write the report here, a .md table and a .png plot beside it")
    bp.add_argument("--combine", metavar="DIR", help="instead of running: the reports in DIR in one table "
                                                     "and plot (DIR/all.md, DIR/all.png)")
    _engine_args(bp, own=("ratio",))
    bp.set_defaults(func=cmd_bench_pipeline)

    cal = sub.add_parser("calibrate", help="choose the recompute ratio for one tier on this machine (profile, "
                                           "cost model, golden-section search); ratio \"auto\" uses it")
    cal.add_argument("--tier", default="cpu", help="the tier, as in --tiers: cpu, disk, disk:/path, "
                                                   "redis://host:port [%(default)s]")
    cal.add_argument("--throttle", help="read the tier at a slower medium's pace: hdd, ssd, nvme, or e.g. "
                                        "60MB/s+5ms (the same as --tier TIER@MEDIUM)")
    cal.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                     help="store the ratio in the calibration file (--calibration) [on]")
    _calibration_args(cal, limit=4)
    _engine_args(cal, own=("tiers",))
    cal.set_defaults(func=cmd_calibrate)

    cp = sub.add_parser("calibrate-price", help="measure deep focus's price over first on this machine, which "
                                                "the deep_within setting scales its predictions by")
    from cachetune.tuning.price import REPEATS

    cp.add_argument("--data", default="musique", help="prompts: dataset name or file (no answers are used) "
                                                      "[%(default)s]")
    cp.add_argument("--limit", type=int, default=4, help="prompts [%(default)s]")
    cp.add_argument("--docs", type=int, default=0, help="documents per prompt (0: all) [%(default)s]")
    cp.add_argument("--repeats", type=int, default=REPEATS, help="timed prefills per prompt and method "
                                                                  "[%(default)s]")
    cp.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                    help="store the scale in the calibration file (--calibration) [on]")
    cp.add_argument("--json", help="write the report here (a .md beside it)")
    _engine_args(cp)
    cp.set_defaults(func=cmd_calibrate_price)

    bc = sub.add_parser("bench-calibrate", help="fixed against calibrated r per tier, the cost model against "
                                                "measurement (paper Table 5, Figure 10)")
    from cachetune.eval.bench_calibrate import DEFAULT_TIERS, CalibrationBenchConfig as CB

    bc.add_argument("--tiers", dest="bench_tiers", default=",".join(DEFAULT_TIERS),
                    help="comma-separated single tiers (slow: a disk throttled below the crossover) [%(default)s]")
    bc.add_argument("--sweep", default=",".join(f"{r:g}" for r in CB.sweep), help="ratios timed [%(default)s]")
    bc.add_argument("--sweep-repeats", type=int, default=CB.repeats,
                    help="timed runs per prompt of every sweep ratio and of the comparison [%(default)s]")
    _calibration_args(bc, limit=3)
    _engine_args(bc, own=("tiers",))
    bc.set_defaults(func=cmd_bench_calibrate)

    sv = sub.add_parser("serve", help="the OpenAI-compatible server (documents, chat and text completions, metrics)")
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    from cachetune.config import ServerConfig

    _field_args(sv, ServerConfig, "server")
    _engine_args(sv)
    sv.set_defaults(func=cmd_serve)

    from cachetune.eval.bench_serve import METHODS, ServeBenchConfig as SB

    bs = sub.add_parser("bench-serve", help="TTFT against Poisson request rate, per method, of a running server "
                                            "(paper Figure 4; loopback only)")
    bs.add_argument("--url", default=SB.url, help="[%(default)s]")
    bs.add_argument("--methods", default=",".join(METHODS), help="comma-separated [%(default)s]")
    bs.add_argument("--rates", default=",".join(f"{r:g}" for r in SB.rates), help="requests/s [%(default)s]")
    bs.add_argument("--requests-per-rate", type=int, default=SB.requests_per_rate, help="[%(default)s]")
    bs.add_argument("--max-seconds", type=float, default=SB.max_seconds_per_rate,
                    help="per rate: stop sending and cancel after this [%(default)s]")
    bs.add_argument("--slo-ms", type=float, default=SB.slo_ms, help="TTFT SLO [%(default)s]")
    bs.add_argument("--slo-percentile", type=float, default=SB.slo_percentile, help="[%(default)s]")
    bs.add_argument("--max-tokens", type=int, default=SB.max_tokens, help="[%(default)s]")
    bs.add_argument("--data", default=SB.data, help="dataset name or file [%(default)s]")
    bs.add_argument("--docs", type=int, default=SB.docs_per_prompt, help="documents per prompt (0: all)")
    bs.add_argument("--prompts", type=int, default=SB.prompts, help="examples cycled through [%(default)s]")
    bs.add_argument("--seed", type=int, default=SB.seed)
    bs.add_argument("--api-key", help="bearer key of the server")
    bs.add_argument("--ratio", type=float, help="recompute share sent with every request (default: the server's)")
    bs.add_argument("--min-rate-share", type=float, default=SB.min_rate_share,
                    help="a rate is sustained only if completed/s >= this x the rate [%(default)s]")
    bs.add_argument("--rescore", metavar="JSON", help="instead of running: judge a saved bench_serve.json again "
                                                      "(with --min-rate-share) and rewrite its table and plot")
    bs.add_argument("--wait", type=float, default=0, help="seconds to wait for the server's /health first [0]")
    bs.add_argument("--out", default="results/serve", help="writes bench_serve.json, .md, ttft_vs_rate.png here")
    bs.set_defaults(func=cmd_bench_serve)

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
    _engine_args(an, own=("ratio", "alpha", "max_new_tokens"))
    an.set_defaults(func=cmd_analyze)

    c2 = sub.add_parser("c2kv", help="C2KV: train the extractor, evaluate it")
    c2_sub = c2.add_subparsers(dest="c2kv_command", required=True)
    tr = c2_sub.add_parser("train", help="train (or resume) a C2KV extractor on the HotpotQA training split")
    _train_args(tr)
    tr.add_argument("--residual", action="store_true", help="the C2KV-Residual variant")
    tr.add_argument("--anchor", action="store_true",
                    help="anchored C2Tokens: each enters as its block's last token's embedding plus the learned "
                         "offset (step 0 starts from keep_every_4th's quality)")
    tr.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on the copied projections (0: full) [0]")
    _engine_args(tr)
    tr.set_defaults(func=cmd_train)
    ce = c2_sub.add_parser("eval", help="C2KV beside its controls and the reuse methods: NLL, gap closed, KL, "
                                        "F1, TTFT, KV bytes, composition")
    ce.add_argument("--data", action="append",
                    help="'heldout' (the HotpotQA held-out split) and/or eval dataset names [heldout]")
    ce.add_argument("--methods", default=c2kv_default_methods(), help="comma-separated")
    ce.add_argument("--ratio", type=float, help=f"recompute budget of the selective methods [{EngineConfig.ratio}]")
    ce.add_argument("--limit", type=int, help="first N examples of each dataset")
    ce.add_argument("--max-new-tokens", type=int, help="default: 32 for QA")
    ce.add_argument("--system", help="system prompt (default: per task)")
    ce.add_argument("--composition", action="store_true", help="also every example with its documents shuffled")
    ce.add_argument("--storage-examples", type=int, default=4, help="examples whose documents size the store [4]")
    ce.add_argument("--json", help="report path (a .md table beside it; resumes from its .progress.jsonl)")
    ce.add_argument("--fresh", action="store_true", help="ignore (delete) earlier progress for --json")
    ce.add_argument("--plots", help="directory for the quality/fidelity vs TTFT PNGs")
    _engine_args(ce, own=("ratio", "max_new_tokens"))
    ce.set_defaults(func=cmd_c2kv_eval)

    _export_args(c2_sub, "c2kv")

    for name, what, flag, default, flag_help in (
        ("kvlink", "KVLink's link tokens", "--links", 5, "link tokens after every document"),
        ("block-attention", "the Block-Attention LoRA (documents attend alone)", "--lora-rank", 16,
         "LoRA rank on every q/k/v/o projection"),
    ):
        group = sub.add_parser(name, help=f"train {what}").add_subparsers(dest=f"{name}_command", required=True)
        train = group.add_parser("train", help=f"train (or resume) {what} on the HotpotQA training split")
        _train_args(train)
        train.add_argument(flag, type=int, default=default, help=f"{flag_help} [{default}]")
        _engine_args(train)
        train.set_defaults(func=cmd_train)
        _export_args(group, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; an error the user can cause or fix is one `cachetune: error: ...` line and exit code 2."""
    from cachetune.errors import CachetuneError

    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        return args.func(args)
    except (CachetuneError, ValueError, KeyError, OSError) as exc:  # OSError covers FileNotFoundError
        # KeyError's str() is the repr of its argument; every message is folded onto one line.
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        text = " ".join(text.split()) or type(exc).__name__
        print(f"cachetune: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
