"""Command line: `cachetune ask` answers over documents, `eval` / `bench` compare methods, `analyze` probes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cachetune.chunks.rankers import DEFAULT_RANKER
from cachetune.config import DTYPES, EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="EngineConfig as .json or .toml; the flags below override it")
    p.add_argument("--model", help="preset (smollm2-135m, qwen2.5-coder-1.5b), HF directory or .gguf file")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--device", help="auto (default: a CUDA GPU when present), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--store", choices=["memory", "disk"])
    p.add_argument("--store-dir")
    p.add_argument("--ranking", help="offline ranker stored with each chunk and read by the cachetune method "
                                     "(lf, lf_v0, probe, probe_head, first, hybrids like first+probe; "
                                     f"default {DEFAULT_RANKER})")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false", default=None,
                   help="load each layer's reused KV only when it is needed (no overlap)")


def _engine(args):
    from cachetune.engine.engine import Engine

    overrides = {"model": args.model, "dtype": args.dtype, "device": args.device, "threads": args.threads,
                 "store": args.store, "store_dir": args.store_dir, "prefetch": args.prefetch,
                 "ranking": args.ranking}
    if args.config:
        config = EngineConfig.from_file(args.config, **overrides)
    else:
        config = EngineConfig(**{k: v for k, v in overrides.items() if v is not None})
    engine = Engine.from_pretrained(config=config)
    if engine.reuse_error:
        print(f"warning: {engine.reuse_error}", file=sys.stderr)
    return engine


def cmd_ask(args) -> int:
    from cachetune.engine.decode import SamplingConfig

    engine = _engine(args)
    ids = [engine.cache_chunk(Path(doc).read_text() + "\n\n") for doc in args.doc]
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    out = engine.generate(ids, args.question, args.system, args.method, args.ratio, sampling)
    print(out.text)
    print(f"[{out.method} r={out.ratio:g}] TTFT {out.ttft_ms:.0f} ms, prompt {out.prompt_tokens} tokens, "
          f"recomputed {out.recomputed_tokens} chunk tokens", file=sys.stderr)
    return 0


def _methods(text: str) -> list[str]:
    from cachetune.engine.engine import METHODS

    return list(METHODS) if text == "all" else [m.strip() for m in text.split(",") if m.strip()]


def _floats(text: str | None) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip()) if text else ()


def _datasets(args, default: str) -> dict:
    """--data values (names or files, repeated or comma-separated) -> {name or file stem: examples}."""
    from cachetune.eval.datasets import DATASETS, load_dataset

    specs = [d for arg in (args.data or [default]) for d in arg.split(",") if d]
    return {(spec if spec in DATASETS else Path(spec).stem): load_dataset(spec, args.limit) for spec in specs}


def cmd_eval(args) -> int:
    from cachetune.eval.datasets import bundled_sample_path
    from cachetune.eval.harness import EvalConfig, config_dict, run_eval
    from cachetune.eval.report import format_tables, plot_ratio_curves, plot_tradeoff, summarize_records, write_json

    datasets = _datasets(args, str(bundled_sample_path()))
    cfg = EvalConfig(methods=_methods(args.methods), ratio=args.ratio, ratios=_floats(args.ratios),
                     max_new_tokens=args.max_new_tokens, repeats=args.repeats, system=args.system)
    engine = _engine(args)
    progress_path = None
    if args.json:
        progress_path = Path(args.json).with_suffix(".progress.jsonl")
        if args.fresh and progress_path.exists():
            progress_path.unlink()
    records = run_eval(engine, datasets, cfg, progress_path)
    report = {"model": engine.name, "dtype": engine.config.dtype, "device": str(engine.adapter.device),
              "threads": torch.get_num_threads(),
              "config": config_dict(cfg), "datasets": summarize_records(records, [v.label for v in cfg.variants()]),
              "examples": records}
    table = format_tables(report)
    print(table)
    if args.json:
        write_json(report, args.json)
        Path(args.json).with_suffix(".md").write_text(table + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        for path in [*plot_tradeoff(report, args.plots), plot_ratio_curves(report, args.plots)]:
            if path is not None:
                print(f"wrote {path}", file=sys.stderr)
    return 0


def _eval_args(p: argparse.ArgumentParser, methods: str, repeats: int) -> None:
    p.add_argument("--data", action="append",
                   help="dataset name (musique, 2wikimqa, hotpotqa, multi_news, samsum, lb_*) or file; "
                        "repeat or comma-separate for several (default: the bundled MuSiQue sample)")
    p.add_argument("--methods", default=methods, help="comma-separated, or 'all'")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--ratios", help="comma-separated budgets: methods that use one run once per r, as name@r")
    p.add_argument("--limit", type=int, help="first N examples of each dataset")
    p.add_argument("--max-new-tokens", type=int, help="default: 32 for QA, 128 for summarization")
    p.add_argument("--repeats", type=int, default=repeats, help="extra timing passes per example")
    p.add_argument("--system", help="system prompt (default: per task)")
    p.add_argument("--json", help="write the report here, a .md table beside it, and resume from "
                                  "its .progress.jsonl")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) earlier progress for --json")
    p.add_argument("--plots", help="directory for the quality/fidelity vs TTFT PNGs")
    _engine_args(p)
    p.set_defaults(func=cmd_eval)


ANALYSES = ("drift", "spectrum", "attention", "sweep", "robustness")


def cmd_analyze(args) -> int:
    from cachetune.eval import analyses, drift, spectrum
    from cachetune.eval.harness import EvalConfig, config_dict, run_eval
    from cachetune.eval.report import format_tables, summarize_records, write_json

    datasets = _datasets(args, "musique")
    engine = _engine(args)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer a question over documents, reusing their cached KV")
    ask.add_argument("--doc", action="append", required=True, help="a text file; repeat for several chunks")
    ask.add_argument("--question", required=True)
    ask.add_argument("--system", help="system prompt (default: answer briefly from the passages)")
    ask.add_argument("--method", default="cachetune")
    ask.add_argument("--ratio", type=float, default=0.15)
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--seed", type=int)
    _engine_args(ask)
    ask.set_defaults(func=cmd_ask)

    ev = sub.add_parser("eval", help="every method on datasets: quality, fidelity, TTFT (JSON, tables, plots)")
    _eval_args(ev, methods="all", repeats=0)
    bench = sub.add_parser("bench", help="a quick eval: full recompute, full reuse and cachetune")
    _eval_args(bench, methods="full_recompute,full_reuse,cachetune", repeats=0)
    an = sub.add_parser("analyze", help="the paper's analyses: drift recall, spectrum, attention, sweeps, robustness")
    an.add_argument("analysis", choices=ANALYSES)
    an.add_argument("--data", action="append", help="dataset names or files (default: musique)")
    an.add_argument("--limit", type=int, default=10, help="first N examples of each dataset (default 10)")
    an.add_argument("--ratio", type=float, default=0.15)
    an.add_argument("--alpha", type=float, default=0.5)
    an.add_argument("--rankers", help="drift / robustness: comma-separated offline rankers to compare")
    an.add_argument("--ratios", help="drift: more ratios to report Recall@r at, comma-separated")
    an.add_argument("--max-new-tokens", type=int, help="sweep / robustness: default per task")
    an.add_argument("--out", default="results/analysis", help="writes <analysis>.json, .md and .png here")
    _engine_args(an)
    an.set_defaults(func=cmd_analyze)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"cachetune: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
