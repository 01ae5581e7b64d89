"""Serving: `ask` answers one question over documents, `serve` runs the OpenAI-compatible server."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from cachetune.cli.common import engine, engine_args, field_args, ratio
from cachetune.config import EngineConfig


def cmd_ask(args) -> int:
    from cachetune.engine.calibration import AUTO
    from cachetune.runtime.decode import SamplingConfig

    eng = engine(args, ratio=None if args.ratio == AUTO else args.ratio)  # "auto" is per request
    ids = [eng.cache_document(Path(doc).read_text()) for doc in args.doc]
    sampling = SamplingConfig(args.max_new_tokens or eng.config.max_new_tokens, args.temperature, args.top_p,
                              args.seed)
    out = eng.generate(ids, args.question, args.system, args.method, args.ratio, sampling)
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
    serve(engine(args), server, log_level=args.log_level)
    return 0


def add_ask(sub) -> None:
    ask = sub.add_parser("ask", help="answer a question over documents, reusing their cached KV")
    ask.add_argument("--doc", action="append", required=True, help="a text file; repeat for several chunks")
    ask.add_argument("--question", required=True)
    ask.add_argument("--system", help="system prompt (default: answer briefly from the passages)")
    ask.add_argument("--method", help=f"registered method or cachetune:<ranking> [{EngineConfig.method}]")
    ask.add_argument("--ratio", type=ratio, help=f"share of chunk tokens recomputed, or \"auto\": the one "
                                                 f"calibrated for the chunks' tier [{EngineConfig.ratio}]")
    ask.add_argument("--max-new-tokens", type=int, help=f"[{EngineConfig.max_new_tokens}]")
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--seed", type=int)
    engine_args(ask, own=("method", "ratio", "max_new_tokens"))
    ask.set_defaults(func=cmd_ask)


def add_serve(sub) -> None:
    from cachetune.config import ServerConfig

    sv = sub.add_parser("serve", help="the OpenAI-compatible server (documents, chat and text completions, metrics)")
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    field_args(sv, ServerConfig, "server")
    engine_args(sv)
    sv.set_defaults(func=cmd_serve)
