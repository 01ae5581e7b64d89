"""Command line: `cachetune ask` answers over documents, `cachetune bench` compares methods."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cachetune.config import DTYPES, EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="EngineConfig as .json or .toml; the flags below override it")
    p.add_argument("--model", help="preset (smollm2-135m, qwen2.5-coder-1.5b), HF directory or .gguf file")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--store", choices=["memory", "disk"])
    p.add_argument("--store-dir")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false", default=None,
                   help="load each layer's reused KV only when it is needed (no overlap)")


def _engine(args):
    from cachetune.engine.engine import Engine

    overrides = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                 "store": args.store, "store_dir": args.store_dir, "prefetch": args.prefetch}
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


def cmd_bench(args) -> int:
    from cachetune.eval.bench import BenchConfig, format_table, run_bench, write_report
    from cachetune.eval.datasets import bundled_sample_path, load_qa

    examples = load_qa(args.data or bundled_sample_path(), limit=args.limit)
    cfg = BenchConfig(methods=args.methods.split(","), ratio=args.ratio, max_new_tokens=args.max_new_tokens,
                      repeats=args.repeats, system=args.system)
    engine = _engine(args)
    report = run_bench(engine, examples, cfg)
    table = format_table(report)
    print(table)
    if args.json:
        write_report(report, args.json)
        Path(args.json).with_suffix(".md").write_text(table + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
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

    bench = sub.add_parser("bench", help="compare methods on a QA dataset against full recompute")
    bench.add_argument("--data", help="CacheBlend-format .json/.jsonl (default: the bundled MuSiQue sample)")
    bench.add_argument("--methods", default="full_recompute,full_reuse,cachetune")
    bench.add_argument("--ratio", type=float, default=0.15)
    bench.add_argument("--limit", type=int)
    bench.add_argument("--max-new-tokens", type=int, default=32)
    bench.add_argument("--repeats", type=int, default=0, help="extra timing passes per example")
    bench.add_argument("--system")
    bench.add_argument("--json", help="write the report here (and a .md table beside it)")
    _engine_args(bench)
    bench.set_defaults(func=cmd_bench)
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
