"""`cachetune bench-pipeline`: the paper's cache-loading ablation (Table 4) on one tier.

The same prompts, cached chunks and recompute selections (cachetune's: the top `ratio` of each
chunk by its stored ranking) are prefilled with the loading optimisations added one at a time:

    sequential      every layer's rows read before the first layer computes; whole chunks read
                    (dense); reused keys rotated in the forward (eager)
    +overlap        layer l+1 read while layer l computes (prefetch)
    +sparse         only the reused rows read (one rank range per chunk)
    +deferred_rope  reused keys rotated on the loading path, off the forward
    full_recompute  the model's own forward over the whole prompt

and two references for the overlap bar: `load` (the full pipeline's reads alone, every layer, no
compute) and `compute` (its forward with every reused row already in memory). TTFT here is the
prefill up to the first token's logits, median over repeats, then over prompts. Variants are
interleaved within each repeat so drift of the machine hits all alike. A disk tier's page cache is
dropped (posix_fadvise DONTNEED) before every timed read, so disk numbers are device reads.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import QAExample
from cachetune.eval.report import pyplot, save_figure
from cachetune.eval.bench_batch import example_prompt
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.runtime.loading import SEQUENTIAL, Pipeline
from cachetune.store.base import ChunkStore
from cachetune.store.blob import ModelShape
from cachetune.store.disk import DiskStore
from cachetune.store.memory import MemoryStore
from cachetune.store.throttled import MEDIA, Medium, ThrottledStore
from cachetune.tuning.profile import load_and_compute, top_selections

TIERS = ("cpu", "disk", "redis", "hdd", "ssd", "nvme", "matched")
VARIANTS = {
    "sequential": SEQUENTIAL,
    "+overlap": Pipeline(overlap=True, sparse=False, deferred_rope=False),
    "+sparse": Pipeline(overlap=True, sparse=True, deferred_rope=False),
    "+deferred_rope": Pipeline(),
}
FULL = "+deferred_rope"  # the full pipeline


@dataclass(frozen=True)
class PipelineBenchConfig:
    tier: str = "cpu"                 # one of TIERS; `matched`: throttled so loading ~ recompute
    ratio: float = EngineConfig.ratio  # share of every chunk recomputed
    repeats: int = 3                  # timed runs of every variant per prompt (after one warm-up)
    documents: int = 0                # documents per prompt (0: all)
    disk_dir: str | None = None       # the disk tier's folder (None: a temporary one)
    redis_url: str = "redis://127.0.0.1:6379"

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {self.tier!r}")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


def _tier_store(engine: Engine, cfg: PipelineBenchConfig, tmp: Path, medium: Medium | None) -> ChunkStore:
    shape = ModelShape(*engine.adapter.kv_shape)
    if cfg.tier == "disk":
        return DiskStore(cfg.disk_dir or tmp, engine.fingerprint, shape=shape)
    if cfg.tier == "redis":
        from cachetune.store.redis import RedisStore

        store = RedisStore(cfg.redis_url, engine.fingerprint, shape=shape)
        if store.call(lambda r: r.ping()) is None:
            raise RuntimeError(f"no Redis at {cfg.redis_url} (start one: redis-server --port 6379)")
        return store
    if medium is not None:  # real reads of real files (from the page cache), paced to the medium
        return ThrottledStore(DiskStore(cfg.disk_dir or tmp, engine.fingerprint, shape=shape), medium)
    return MemoryStore(pinned=engine.adapter.device.type == "cuda")


def moved_layout(layout: PromptLayout, store: ChunkStore) -> PromptLayout:
    """`layout` with its chunks stored in, and read from, `store`."""
    segments = []
    for seg in layout.segments:
        if seg.cached:
            store.put(seg.chunk.encoded())
            seg = Segment(seg.token_ids, store.get(seg.chunk.chunk_id))
        segments.append(seg)
    return PromptLayout(segments)


def _timed(fn, before=None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _load_and_compute(engine: Engine, layout: PromptLayout, selections, before) -> tuple[float, float, int]:
    """(ms to read every layer's reused rows, ms of the forward with them in memory, bytes read)."""
    load_s, compute_s, nbytes = load_and_compute(engine, layout, selections, before)
    return load_s * 1000, compute_s * 1000, nbytes


def matched_medium(engine: Engine, layouts: list[PromptLayout], ratio: float) -> tuple[Medium, dict]:
    """A medium whose reads of the reuse complement take as long as the forward (from a profile on
    the memory tier): bandwidth = bytes read / compute time, no latency."""
    store = MemoryStore()
    samples = [_load_and_compute(engine, moved_layout(l, store), top_selections(l, ratio), None) for l in layouts]
    compute_s = statistics.median(s[1] for s in samples) / 1000
    nbytes = statistics.median(s[2] for s in samples)
    return Medium(nbytes / compute_s), {"compute_ms": compute_s * 1000, "bytes": nbytes,
                                        "bandwidth_MBps": nbytes / compute_s / 1e6}


def run_bench_pipeline(engine: Engine, examples: list[QAExample], cfg: PipelineBenchConfig,
                       progress: bool = True) -> dict:
    """The ablation on `cfg.tier`; a JSON-ready report (per variant: median TTFT, ratios)."""
    layouts = [example_prompt(engine, ex, cfg.documents) for ex in examples]
    profile = None
    medium = MEDIA.get(cfg.tier)
    if cfg.tier == "matched":
        medium, profile = matched_medium(engine, layouts, cfg.ratio)
    with tempfile.TemporaryDirectory(prefix="cachetune-bench-") as tmp:
        store = _tier_store(engine, cfg, Path(tmp), medium)
        before = store.drop_page_cache if isinstance(store, DiskStore) else None
        names = [*VARIANTS, "full_recompute", "load", "compute"]
        per_prompt: dict[str, list[float]] = {n: [] for n in names}
        tokens, loaded = [], []
        bar = tqdm(total=len(layouts) * (cfg.repeats + 1) * len(names), desc=f"bench-pipeline {cfg.tier}",
                   disable=not progress)
        for layout in layouts:
            moved = moved_layout(layout, store)
            chosen = top_selections(moved, cfg.ratio)
            tokens.append(layout.total)
            runs = {n: [] for n in names}
            for rep in range(cfg.repeats + 1):  # the first pass warms up and is not counted
                for name, pipeline in VARIANTS.items():
                    ms = _timed(lambda: selective_prefill(engine.adapter, moved, chosen, moved.total, pipeline), before)
                    runs[name].append(ms)
                runs["full_recompute"].append(_timed(lambda: full_prefill(engine.adapter, moved, moved.total)))
                load_ms, compute_ms, nbytes = _load_and_compute(engine, moved, chosen, before)
                runs["load"].append(load_ms)
                runs["compute"].append(compute_ms)
                bar.update(len(names))
            loaded.append(nbytes)
            for name in names:
                per_prompt[name].append(statistics.median(runs[name][1:]))
        bar.close()
    ttft = {name: statistics.median(values) for name, values in per_prompt.items()}
    overlap_floor = [max(l, c) for l, c in zip(per_prompt["load"], per_prompt["compute"])]
    full_vs_floor = statistics.median(f / m for f, m in zip(per_prompt[FULL], overlap_floor))
    return {
        "config": asdict(cfg),
        "medium": asdict(medium) if medium is not None else None,
        "matched_profile": profile,
        "prompts": len(layouts),
        "median_prompt_tokens": statistics.median(tokens),
        "median_loaded_MB": statistics.median(loaded) / 1e6,
        "ttft_ms": ttft,
        "per_prompt_ms": per_prompt,
        "speedup_over_sequential": {n: ttft["sequential"] / ttft[n] for n in VARIANTS},
        "speedup_over_full_recompute": {n: ttft["full_recompute"] / ttft[n] for n in VARIANTS},
        "full_over_max_load_compute": full_vs_floor,
    }


def format_pipeline_table(report: dict) -> str:
    cfg = report["config"]
    medium = report["medium"]
    where = f"tier `{cfg['tier']}`" + (f" ({medium['bandwidth'] / 1e6:.0f} MB/s, {medium['latency_s'] * 1e3:g} ms a read)"
                                        if medium else "")
    lines = [f"Cache-loading ablation on {where}, r = {cfg['ratio']}, {report['prompts']} prompts "
             f"(median {report['median_prompt_tokens']:.0f} tokens, {report['median_loaded_MB']:.1f} MB reused KV read "
             f"per request by the full pipeline)", "",
             "| configuration | TTFT ms (median) | vs sequential | vs full recompute |", "|---|---|---|---|"]
    t = report["ttft_ms"]
    for name in VARIANTS:
        lines.append(f"| {name} | {t[name]:.1f} | {report['speedup_over_sequential'][name]:.2f}x | "
                     f"{report['speedup_over_full_recompute'][name]:.2f}x |")
    lines.append(f"| full_recompute | {t['full_recompute']:.1f} | | 1.00x |")
    lines += ["", f"References: load alone {t['load']:.1f} ms, compute alone {t['compute']:.1f} ms; the full pipeline "
                  f"is {report['full_over_max_load_compute']:.2f}x max(load, compute) (median over prompts)."]
    return "\n".join(lines)


def plot_pipeline(reports: list[dict], path: str | Path) -> Path:
    """Median TTFT of every configuration, one group of bars per tier (the reports of one or more runs)."""
    plt = pyplot()
    names = [*VARIANTS, "full_recompute"]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(reports)), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(reports))]
        ax.bar(xs, [r["ttft_ms"][name] / 1000 for r in reports], width, label=name)
    ax.set_xticks(range(len(reports)), [r["config"]["tier"] for r in reports])
    ax.set(ylabel="TTFT (s, median)", title=f"cache-loading ablation, r = {reports[0]['config']['ratio']}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, "each tier: the same prompts, chunks and selections")


def format_summary_table(reports: list[dict]) -> str:
    """One row per tier: every configuration's median TTFT and the bars' ratios."""
    lines = ["| tier | medium | sequential | +overlap | +sparse | +deferred_rope | full recompute | load alone | "
             "compute alone | full / max(load, compute) | full vs sequential | full vs recompute |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        t, m = r["ttft_ms"], r["medium"]
        medium = f"{m['bandwidth'] / 1e6:.0f} MB/s + {m['latency_s'] * 1e3:g} ms" if m else ""
        cells = [f"{t[n]:.0f}" for n in (*VARIANTS, "full_recompute", "load", "compute")]
        lines.append(f"| {r['config']['tier']} | {medium} | " + " | ".join(cells) +
                     f" | {r['full_over_max_load_compute']:.2f} | {r['speedup_over_sequential'][FULL]:.2f}x"
                     f" | {r['speedup_over_full_recompute'][FULL]:.2f}x |")
    return "\n".join(lines)
