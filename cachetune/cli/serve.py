"""Serving: `ask` answers one question over documents, `serve` runs the OpenAI-compatible server,
`vllm-serve` starts vLLM's own server with cachetune inside it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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


def cmd_vllm_serve(args) -> int:
    from cachetune.vllm.api import model_dir
    from cachetune.vllm.serve import serve_command

    settings = {name: getattr(args, name) for name in ("method", "ratio", "ranking", "blends_per_step")
                if getattr(args, name) is not None}
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    argv, env = serve_command(model_dir(args.model), args.tiers, args.host, args.port, settings, extra)
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vllm is not installed here (make vllm)")
    print(" ".join(argv), file=sys.stderr)
    os.execve(argv[0], argv, {**os.environ, **env})  # vLLM's server replaces this process


def add_vllm_serve(sub) -> None:
    from cachetune.vllm.config import ConnectorSettings

    defaults = ConnectorSettings()
    vs = sub.add_parser("vllm-serve", help="vLLM's OpenAI server with cachetune inside it: the connector, "
                                           "POST /v1/documents, blended requests salted (needs `make vllm`)")
    vs.add_argument("--model", help="preset, .gguf or HF directory [the bundled SmolLM2-135M-Instruct]")
    vs.add_argument("--tiers", help=f"where documents are stored, as --tiers of `serve` [{defaults.tiers}]")
    vs.add_argument("--host", default="127.0.0.1", help="[127.0.0.1]")
    vs.add_argument("--port", type=int, default=8000, help="[8000]")
    vs.add_argument("--method", help=f"selection of a request that names none [{defaults.method}]")
    vs.add_argument("--ratio", type=float, help=f"share of document tokens recomputed [{defaults.ratio}]")
    vs.add_argument("--ranking", help=f"offline ranking stored with each document [{defaults.ranking}]")
    vs.add_argument("--blends-per-step", type=int,
                    help=f"blends started per engine step, 0 for no limit [{defaults.blends_per_step}]")
    vs.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: arguments for `vllm serve` itself")
    vs.set_defaults(func=cmd_vllm_serve)
