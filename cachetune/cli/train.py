"""The trained add-ons: `c2kv` (train, eval, export the extractor), `kvlink` and `block-attention`
(train, export), all on one training loop."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import replace
from pathlib import Path

import torch

from cachetune.cli.common import datasets, engine, engine_args, flag_type, methods, report_out
from cachetune.config import DTYPES, EngineConfig


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
    eng = engine(args)
    state = train_tokens(eng, args.out, cfg, kind, config, args.heldout, args.split_seed, args.max_steps)
    curve = plot_history(json.loads((Path(args.out) / STATE).read_text())["history"], Path(args.out) / "curve.png",
                         f"{kind.VARIANT} training, {eng.name}", loss_label(cfg))
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
    sets = {}
    if "heldout" in specs:
        sets["heldout"] = c2kv_eval.heldout_examples(args.limit)
    rest = [d for d in specs if d != "heldout"]
    if rest:
        args.data = rest
        sets.update(datasets(args, "musique"))
    cfg = EvalConfig(methods=methods(args.methods), ratio=EngineConfig.ratio if args.ratio is None else args.ratio,
                     max_new_tokens=args.max_new_tokens, system=args.system, gold_nll=True)
    eng = engine(args)
    cfg = replace(cfg, ratio=eng.config.ratio)
    settings = (Setting(),) + ((Setting(c2kv_eval.SHUFFLED, shuffle=True),) if args.composition else ())
    progress_path = Path(args.json).with_suffix(".progress.jsonl") if args.json else None
    if args.fresh and progress_path is not None and progress_path.exists():
        progress_path.unlink()
    records = run_eval(eng, sets, cfg, progress_path, settings=settings)
    labels = [v.label for v in cfg.variants()]
    # Storage is sized for the first C2KV method's extractor, over the first examples' documents.
    c2 = next((eng.method(m).settings.extractor for m in cfg.methods if m.split(":")[0] == "c2kv"), None)
    first = next(iter(sets.values()))[: args.storage_examples]
    storage = c2kv_eval.stored_bytes_per_token(eng, first, c2) if c2 is not None else None
    report = {"model": eng.name, "dtype": eng.config.dtype, "device": str(eng.adapter.device),
              "threads": torch.get_num_threads(), "extractor": c2, "config": config_dict(cfg), "storage": storage,
              "datasets": summarize_records(records, labels), "examples": records}
    report_out(report, c2kv_eval.format_c2kv_tables(report), args.json)
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
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=flag_type(hints[f.name]),
                           help=f"[{f.default}]")


def _export_args(sub, name: str) -> None:
    ex = sub.add_parser("export", help="copy trained weights in another dtype (what is shipped)")
    ex.add_argument("src", help=f"a weights.safetensors of `cachetune {name} train`")
    ex.add_argument("dst", help="where to write it (files in cachetune/c2kv/weights/ are what 'bundled' finds)")
    ex.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ex.set_defaults(func=cmd_export)


def add_c2kv(sub) -> None:
    from cachetune.eval.c2kv_eval import DEFAULT_METHODS

    c2 = sub.add_parser("c2kv", help="C2KV: train the extractor, evaluate it")
    c2_sub = c2.add_subparsers(dest="c2kv_command", required=True)
    tr = c2_sub.add_parser("train", help="train (or resume) a C2KV extractor on the HotpotQA training split")
    _train_args(tr)
    tr.add_argument("--residual", action="store_true", help="the C2KV-Residual variant")
    tr.add_argument("--anchor", action="store_true",
                    help="anchored C2Tokens: each enters as its block's last token's embedding plus the learned "
                         "offset (step 0 starts from keep_every_4th's quality)")
    tr.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on the copied projections (0: full) [0]")
    engine_args(tr)
    tr.set_defaults(func=cmd_train)
    ce = c2_sub.add_parser("eval", help="C2KV beside its controls and the reuse methods: NLL, gap closed, KL, "
                                        "F1, TTFT, KV bytes, composition")
    ce.add_argument("--data", action="append",
                    help="'heldout' (the HotpotQA held-out split) and/or eval dataset names [heldout]")
    ce.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated")
    ce.add_argument("--ratio", type=float, help=f"recompute budget of the selective methods [{EngineConfig.ratio}]")
    ce.add_argument("--limit", type=int, help="first N examples of each dataset")
    ce.add_argument("--max-new-tokens", type=int, help="default: 32 for QA")
    ce.add_argument("--system", help="system prompt (default: per task)")
    ce.add_argument("--composition", action="store_true", help="also every example with its documents shuffled")
    ce.add_argument("--storage-examples", type=int, default=4, help="examples whose documents size the store [4]")
    ce.add_argument("--json", help="report path (a .md table beside it; resumes from its .progress.jsonl)")
    ce.add_argument("--fresh", action="store_true", help="ignore (delete) earlier progress for --json")
    ce.add_argument("--plots", help="directory for the quality/fidelity vs TTFT PNGs")
    engine_args(ce, own=("ratio", "max_new_tokens"))
    ce.set_defaults(func=cmd_c2kv_eval)
    _export_args(c2_sub, "c2kv")


def add_trained_baselines(sub) -> None:
    """`kvlink` and `block-attention`: the same train and export commands, each with its own size flag."""
    for name, what, flag, default, flag_help in (
        ("kvlink", "KVLink's link tokens", "--links", 5, "link tokens after every document"),
        ("block-attention", "the Block-Attention LoRA (documents attend alone)", "--lora-rank", 16,
         "LoRA rank on every q/k/v/o projection"),
    ):
        group = sub.add_parser(name, help=f"train {what}").add_subparsers(dest=f"{name}_command", required=True)
        train = group.add_parser("train", help=f"train (or resume) {what} on the HotpotQA training split")
        _train_args(train)
        train.add_argument(flag, type=int, default=default, help=f"{flag_help} [{default}]")
        engine_args(train)
        train.set_defaults(func=cmd_train)
        _export_args(group, name)
