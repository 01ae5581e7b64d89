"""Benchmarks of serving: `bench-batch` (concurrent requests in the step loop), `bench-pipeline` (the
cache-loading ablation per tier) and `bench-serve` (a running server under Poisson load)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cachetune.cli.common import engine, engine_args, floats, report_out
from cachetune.config import EngineConfig

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
    eng = engine(args)
    report = run_bench_batch(eng, sets, cfg)
    report["data"] = {name: spec for name, spec in (("short", args.short), ("long", args.long)) if spec}
    report_out(report, format_batch_table(report), args.json, plot_batch)
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
        report_out({"reports": reports}, format_summary_table(reports), str(folder / "all.json"))
        print(f"wrote {plot_pipeline(reports, folder / 'all.png')}", file=sys.stderr)
        return 0
    cfg = PipelineBenchConfig(tier=args.tier, ratio=EngineConfig.ratio if args.ratio is None else args.ratio,
                              repeats=args.repeats, documents=args.docs, disk_dir=args.dir, redis_url=args.redis_url)
    examples = load_dataset(args.data, args.limit)
    report = run_bench_pipeline(engine(args), examples, cfg)
    report["data"] = args.data
    report_out(report, format_pipeline_table(report), args.json, lambda r, png: plot_pipeline([r], png))
    return 0


def cmd_bench_serve(args) -> int:
    from cachetune.eval.bench_serve import (ServeBenchConfig, format_table, rescore, run_bench_serve,
                                            wait_until_healthy, write_report)

    if args.rescore:  # a saved report judged again (by another --min-rate-share or --slo-ms)
        report = json.loads(Path(args.rescore).read_text())
        report["config"]["min_rate_share"] = args.min_rate_share
        if args.slo_ms is not None:
            report["config"]["slo_ms"] = args.slo_ms
        report = rescore(report)
        print(format_table(report))
        for path in write_report(report, Path(args.rescore).parent):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    if args.combine:
        from cachetune.eval.bench_serve import combine, plot_ttft_vs_rate
        from cachetune.eval.report import write_json

        report = combine(args.combine, [a for a in args.arms.split(",") if a], args.slo_ms)
        out = Path(args.combine)
        write_json(report, out / "all.json")
        (out / "all.md").write_text(format_table(report) + "\n", encoding="utf-8")
        plot_ttft_vs_rate(report, out / "all.png")
        print(format_table(report))
        return 0
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    config = ServeBenchConfig(url=args.url, methods=methods, rates=floats(args.rates),
                              requests_per_rate=args.requests_per_rate, max_seconds_per_rate=args.max_seconds,
                              slo_ms=ServeBenchConfig.slo_ms if args.slo_ms is None else args.slo_ms,
                              slo_percentile=args.slo_percentile, max_tokens=args.max_tokens,
                              data=args.data, docs_per_prompt=args.docs, prompts=args.prompts, seed=args.seed,
                              api_key=args.api_key, ratio=args.ratio, min_rate_share=args.min_rate_share,
                              documents_as=args.documents_as)
    if args.wait:
        wait_until_healthy(config.url, args.wait)
    report = run_bench_serve(config)
    print(format_table(report))
    for path in write_report(report, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def add_bench_batch(sub) -> None:
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
    engine_args(bb, own=("method", "ratio", "max_new_tokens"))
    bb.set_defaults(func=cmd_bench_batch)


def add_bench_pipeline(sub) -> None:
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
    engine_args(bp, own=("ratio",))
    bp.set_defaults(func=cmd_bench_pipeline)


def add_bench_serve(sub) -> None:
    from cachetune.eval.bench_serve import DOCUMENTS_AS, METHODS, ServeBenchConfig as SB

    bs = sub.add_parser("bench-serve", help="TTFT against Poisson request rate, per method, of a running server "
                                            "(paper Figure 4; loopback only)")
    bs.add_argument("--url", default=SB.url, help="[%(default)s]")
    bs.add_argument("--methods", default=",".join(METHODS), help="comma-separated [%(default)s]")
    bs.add_argument("--rates", default=",".join(f"{r:g}" for r in SB.rates), help="requests/s [%(default)s]")
    bs.add_argument("--requests-per-rate", type=int, default=SB.requests_per_rate, help="[%(default)s]")
    bs.add_argument("--max-seconds", type=float, default=SB.max_seconds_per_rate,
                    help="per rate: stop sending and cancel after this [%(default)s]")
    bs.add_argument("--slo-ms", type=float, help=f"TTFT SLO [{SB.slo_ms:g}; with --rescore or --combine: the "
                                                 "report's]")
    bs.add_argument("--slo-percentile", type=float, default=SB.slo_percentile, help="[%(default)s]")
    bs.add_argument("--max-tokens", type=int, default=SB.max_tokens, help="[%(default)s]")
    bs.add_argument("--data", default=SB.data, help="dataset name or file [%(default)s]")
    bs.add_argument("--docs", type=int, default=SB.docs_per_prompt, help="documents per prompt (0: all)")
    bs.add_argument("--prompts", type=int, default=SB.prompts, help="examples cycled through [%(default)s]")
    bs.add_argument("--seed", type=int, default=SB.seed)
    bs.add_argument("--api-key", help="bearer key of the server")
    bs.add_argument("--ratio", type=float, help="recompute share sent with every request (default: the server's)")
    bs.add_argument("--documents-as", default=SB.documents_as, choices=DOCUMENTS_AS,
                    help="ids: cachetune serve's `documents`; kv_transfer_params: texts in the message and ids for "
                         "vLLM's cachetune connector; text: texts only (vLLM alone; --methods is then a label) "
                         "[%(default)s]")
    bs.add_argument("--min-rate-share", type=float, default=SB.min_rate_share,
                    help="a rate is sustained only if completed/s >= this x the rate [%(default)s]")
    bs.add_argument("--combine", metavar="DIR", help="instead of running: DIR/<arm>/bench_serve.json of --arms in one "
                                                     "table and plot (DIR/all.{json,md,png})")
    bs.add_argument("--arms", default="vllm,vllm_cachetune,cachetune", help="with --combine [%(default)s]")
    bs.add_argument("--rescore", metavar="JSON", help="instead of running: judge a saved bench_serve.json again "
                                                      "(with --min-rate-share) and rewrite its table and plot")
    bs.add_argument("--wait", type=float, default=0, help="seconds to wait for the server's /health first [0]")
    bs.add_argument("--out", default="results/serve", help="writes bench_serve.json, .md, ttft_vs_rate.png here")
    bs.set_defaults(func=cmd_bench_serve)


def cmd_bench_vllm(args) -> int:
    from cachetune.eval.datasets import load_dataset
    from cachetune.vllm.bench import CONCURRENT, VllmBenchConfig, format_vllm_table, plot_vllm, run_bench_vllm

    methods = tuple(m for m in args.methods.split(",") if m)
    cfg = VllmBenchConfig(methods=methods, ratio=args.ratio, threads=args.threads, decode_tokens=args.decode_tokens,
                          enforce_eager=args.enforce_eager, short_documents=args.short_docs)
    short = load_dataset(args.short, CONCURRENT) if args.short else []
    report = run_bench_vllm(load_dataset(args.data, args.limit), cfg, short)
    report["data"] = {"long": args.data, "short": args.short}
    report_out(report, format_vllm_table(report), args.json, plot_vllm)
    return 0


def add_bench_vllm(sub) -> None:
    from cachetune.vllm.bench import VllmBenchConfig

    defaults = VllmBenchConfig()
    bv = sub.add_parser("bench-vllm", help="vLLM's own prefill against vLLM with the cachetune connector and "
                                           "the standalone engine, documents reordered (needs `make vllm`)")
    bv.add_argument("--data", default="musique", help="dataset of the TTFT rows and the long prompts [musique]")
    bv.add_argument("--short", default="2wikimqa", help="dataset of the short prompts decode also runs on ('' to "
                                                         "skip) [2wikimqa]")
    bv.add_argument("--short-docs", type=int, default=defaults.short_documents,
                    help=f"documents per short prompt [{defaults.short_documents}: about 1.4K tokens]")
    bv.add_argument("--limit", type=int, default=3, help="examples [3]")
    bv.add_argument("--methods", default=",".join(defaults.methods),
                    help=f"connector methods [{','.join(defaults.methods)}]")
    bv.add_argument("--ratio", type=float, default=defaults.ratio, help=f"recompute budget [{defaults.ratio}]")
    bv.add_argument("--threads", type=int, default=defaults.threads, help=f"CPU threads of every arm [{defaults.threads}]")
    bv.add_argument("--decode-tokens", type=int, default=defaults.decode_tokens,
                    help=f"tokens each of the 8 concurrent requests decodes [{defaults.decode_tokens}]")
    bv.add_argument("--enforce-eager", action="store_true", help="run vLLM without compilation (starts faster)")
    bv.add_argument("--json", help="write the report here, a .md table and a .png plot beside it")
    bv.set_defaults(func=cmd_bench_vllm)
