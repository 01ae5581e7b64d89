"""Command line: `demo` shows one question answered with and without reuse, `ask` answers over
documents, `serve` runs the HTTP server, `vllm-serve` vLLM's with cachetune inside, `eval` / `bench` compare methods, `bench-batch` measures
concurrent serving, `bench-serve` a running server, `analyze` probes. Every command that runs the
engine takes one flag per EngineConfig field (derived from the dataclass, so a new setting is a new
flag) plus `--config`."""

from __future__ import annotations

import argparse
import sys

import torch

from cachetune.cli import analyze, bench, calibrate, demo, serve, train
from cachetune.cli import eval as evaluate


def build_parser() -> argparse.ArgumentParser:
    """Every command group adds its own subcommands, in the order the help lists them."""
    parser = argparse.ArgumentParser(prog="cachetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_demo(sub)
    serve.add_ask(sub)
    evaluate.add_eval(sub)
    evaluate.add_bench(sub)
    bench.add_bench_batch(sub)
    bench.add_bench_pipeline(sub)
    bench.add_bench_vllm(sub)
    calibrate.add_calibrate(sub)
    calibrate.add_calibrate_price(sub)
    calibrate.add_bench_calibrate(sub)
    serve.add_serve(sub)
    serve.add_vllm_serve(sub)
    bench.add_bench_serve(sub)
    analyze.add_analyze(sub)
    train.add_c2kv(sub)
    train.add_trained_baselines(sub)
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
