"""Which chunk tokens drift most between independent and full-context encoding, and who finds them.

Paper appendix E.2 claims that ranking a chunk's tokens by the magnitude of the low-frequency
reconstruction of its K/V (`lf`) recovers most of the tokens whose KV changes most once the chunk
sits in a real prompt (Recall@15% ~86-90% vs ~15% for random). This module measures that claim.

Drift (the exact definition, also stored in every report as `DRIFT_DEFINITION`): for a chunk of N
tokens, with K before RoPE and everything in float32,

    dK[l, i] = || K_ctx[l, i] - K_alone[l, i] ||_2   over (kv_heads, head_dim)
    dV[l, i] = || V_ctx[l, i] - V_alone[l, i] ||_2
    drift[i] = mean over layers l of ( 0.5 * dK[l, i] / sum_j dK[l, j] + 0.5 * dV[l, i] / sum_j dV[l, j] )

where "alone" is the chunk encoded on its own at positions 0..N-1 (what the store holds) and "ctx"
is the same tokens in one forward over the whole prompt. A layer whose total K (or V) drift is at
the float noise floor (below `NOISE_FLOOR` times the layer's total K (or V) norm) contributes 0 for
that part instead of amplified rounding noise: layer 0's K/V are projections of the embeddings alone
and cannot drift. Per chunk the `ratio` share of tokens with the largest drift is the reference set;
Recall@r of a ranker = |its top-r tokens ∩ reference| / |reference|.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cachetune.config import EngineConfig
from cachetune.chunks.kv import encode_kv
from cachetune.chunks.rankers import ChunkView, get_ranker
from cachetune.chunks.ranking import NOISE_FLOOR, kv_drift, layer_drift, lf_scores, ranking_from_scores, top_share
from cachetune.runtime.layout import PromptLayout
from cachetune.engine.prompt import DOCUMENT_SEPARATOR
from cachetune.eval.datasets import QAExample
from cachetune.model.adapter import ModelAdapter

DECILES = 10
EARLY_SHARE = 0.15  # "the start of a chunk" for the position profile

DRIFT_DEFINITION = (
    "drift[i] = mean_l( 0.5*dK[l,i]/sum_j dK[l,j] + 0.5*dV[l,i]/sum_j dV[l,j] ), "
    "dK[l,i] = ||K_ctx[l,i] - K_alone[l,i]||_2 over (heads, dims), keys before RoPE, same for V; "
    "float32; alone = chunk encoded at positions 0..N-1 with nothing before it, ctx = one forward over "
    f"the whole prompt; a layer part whose total drift < {NOISE_FLOOR:g} x its total norm counts as 0; "
    "reference = top ratio*N tokens by drift (ties: earlier token first)"
)


def context_kv(adapter: ModelAdapter, layout: PromptLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values [L, T, Hkv, D] of every prompt token, encoded in full context."""
    return encode_kv(adapter, layout.input_ids)


def recall_at(selected: torch.Tensor, reference: torch.Tensor) -> float:
    """|selected ∩ reference| / |reference| (indices; an empty reference is an error)."""
    if reference.numel() == 0:
        raise ValueError("recall over an empty reference set is undefined")
    hits = torch.isin(reference, selected).sum()
    return float(hits) / reference.numel()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two score vectors [N] (NaN when either is constant)."""
    ra = a.float().argsort().argsort().float()
    rb = b.float().argsort().argsort().float()
    if a.float().std() == 0 or b.float().std() == 0:
        return math.nan
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def position_profile(drift: torch.Tensor, bins: int = DECILES) -> torch.Tensor:
    """Share of a chunk's total drift [N] in each of `bins` equal spans of relative position."""
    n = drift.numel()
    which = (torch.arange(n) * bins) // n  # [N] bin of each token
    shares = torch.zeros(bins).index_add_(0, which, drift.float().cpu())
    return shares / shares.sum().clamp_min(torch.finfo(torch.float32).tiny)


@dataclass
class DriftConfig:
    ratio: float = EngineConfig.ratio
    rankers: tuple[str, ...] = ("lf", "highfreq", "l2", "random", "first")
    alpha: float = EngineConfig.alpha
    separator: str = DOCUMENT_SEPARATOR  # appended to every document, as `cachetune bench` does
    ratios: tuple[float, ...] = ()       # more ratios to report Recall@r at (the reference changes with r)

    def __post_init__(self) -> None:
        for r in (self.ratio, *self.ratios):
            if not 0.0 < r <= 1.0:
                raise ValueError(f"ratio must be in (0, 1], got {r}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        for name in self.rankers:
            get_ranker(name, self.alpha)  # a clear error for an unknown ranker

    @property
    def all_ratios(self) -> tuple[float, ...]:
        return tuple(dict.fromkeys((self.ratio, *self.ratios)))


@dataclass
class _Totals:
    """Per-chunk measurements accumulated over the run."""

    recall: dict[str, list[float]]
    recall_at: dict[float, dict[str, list[float]]] = field(default_factory=dict)
    rank_ms: dict[str, list[float]] = field(default_factory=dict)  # offline cost per chunk
    encode_ms: list[float] = field(default_factory=list)          # the chunk's own encode
    random_expected: list[float] = field(default_factory=list)
    profile: list[torch.Tensor] = field(default_factory=list)
    early: list[float] = field(default_factory=list)
    spearman_lf: list[float] = field(default_factory=list)
    rel_k: list[torch.Tensor] = field(default_factory=list)  # [L] per chunk
    rel_v: list[torch.Tensor] = field(default_factory=list)


def _chunk_kv(chunk, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Alone K/V [L, N, Hkv, D] of a stored chunk, read from its tier layer by layer."""
    idx = torch.arange(chunk.num_tokens)
    pairs = [chunk.load_layer(layer, idx) for layer in range(num_layers)]
    return torch.stack([k for k, _ in pairs]).cpu(), torch.stack([v for _, v in pairs]).cpu()


def _relative(alone: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """Per layer: total drift / total norm over the chunk [L] (how big drift is, not where)."""
    return layer_drift(alone, ctx).sum(1) / ctx.float().flatten(2).norm(dim=2).sum(1).clamp_min(1e-30)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1000


def _measure_chunk(k, v, ck, cv, view: ChunkView, rankers: dict, config: DriftConfig, totals: _Totals) -> dict | None:
    n = view.token_ids.numel()
    drift = kv_drift(k, v, ck, cv)  # [N]
    by_drift = ranking_from_scores(drift)
    reference = top_share(by_drift, config.ratio)
    if reference.numel() == 0:  # chunk too short for ratio*N to round to one token
        return None
    orders = {}
    for name, ranker in rankers.items():
        orders[name], ms = _timed(lambda: ranker.ranking(view))
        totals.rank_ms.setdefault(name, []).append(ms)
    recalls = {}
    for name, order in orders.items():
        recalls[name] = recall_at(top_share(order, config.ratio), reference)
        totals.recall[name].append(recalls[name])
    for r in config.all_ratios:
        ref = top_share(by_drift, r)
        if ref.numel():
            for name, order in orders.items():
                totals.recall_at.setdefault(r, {}).setdefault(name, []).append(recall_at(top_share(order, r), ref))
    early = torch.arange(n)[: max(1, int(math.floor(EARLY_SHARE * n + 0.5)))]
    totals.random_expected.append(reference.numel() / n)
    totals.profile.append(position_profile(drift))
    totals.early.append(recall_at(early, reference))
    totals.spearman_lf.append(spearman(lf_scores(k, v, config.alpha), drift))
    totals.rel_k.append(_relative(k, ck))
    totals.rel_v.append(_relative(v, cv))
    return {"tokens": n, "recall": recalls, "spearman_lf": totals.spearman_lf[-1]}


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _nanmean(xs: list[float]) -> float:
    kept = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(kept) if kept else math.nan


def run_drift_recall(engine, examples: list[QAExample], config: DriftConfig | None = None,
                     progress: bool = True) -> dict:
    """Recall@ratio of each ranker against the high-drift tokens of every chunk of every example.

    `engine` needs `name`, `adapter`, `cache_chunk(text)`, `chunk(id)` and `build_prompt(ids, question)`,
    and `rankings.context()` for rankers that run the model (cachetune.Engine has them all). Returns a JSON-ready report; see format_drift_table for the summary.
    """
    config = config or DriftConfig()
    adapter = engine.adapter
    totals = _Totals(recall={name: [] for name in config.rankers})
    rankers = {name: get_ranker(name, config.alpha) for name in config.rankers}
    context = engine.rankings.context() if any(r.needs_model for r in rankers.values()) else None
    if context is not None:  # probe prefixes are encoded once per engine: not a per-chunk cost
        for i in range(len(context.probes)):
            context.probes.probe(i)
    records, skipped = [], 0
    for ex in tqdm(examples, desc="drift", disable=not progress):
        ids = [engine.cache_chunk(doc + config.separator) for doc in ex.documents]
        layout = engine.build_prompt(ids, ex.question)
        ctx_k, ctx_v = (x.cpu() for x in context_kv(adapter, layout))  # [L, T, Hkv, D]
        chunks = []
        for start, seg in layout.chunk_segments:
            k, v = _chunk_kv(seg.chunk, adapter.num_layers)
            _, encode_ms = _timed(lambda: encode_kv(adapter, seg.chunk.token_ids))  # what caching it costs
            totals.encode_ms.append(encode_ms)
            n = seg.chunk.num_tokens
            ck, cv = ctx_k[:, start : start + n], ctx_v[:, start : start + n]
            view = ChunkView(seg.chunk.token_ids, k, v, context)
            record = _measure_chunk(k, v, ck, cv, view, rankers, config, totals)
            if record is None:
                skipped += 1
                continue
            chunks.append({"start": start, **record})
        records.append({"id": ex.id, "prompt_tokens": layout.total, "chunks": chunks})
    measured = [r for r in records if r["chunks"]]
    by_example = {
        name: statistics.fmean(statistics.fmean(c["recall"][name] for c in r["chunks"]) for r in measured)
        for name in config.rankers
    } if measured else {}
    return {
        "model": engine.name,
        "drift_definition": DRIFT_DEFINITION,
        "ratio": config.ratio,
        "alpha": config.alpha,
        "examples": len(examples),
        "chunks": len(totals.random_expected),
        "chunks_skipped_too_short": skipped,
        "recall": {name: _mean(vals) for name, vals in totals.recall.items()},
        "recall_by_example": by_example,
        "recall_by_ratio": {f"{r:g}": {name: _mean(vals) for name, vals in by_name.items()}
                            for r, by_name in totals.recall_at.items()},
        "offline_cost": {
            name: {"ms_per_chunk": _mean(ms), "times_encode": _mean(ms) / _mean(totals.encode_ms)}
            for name, ms in totals.rank_ms.items()
        } if totals.encode_ms else {},
        "encode_ms_per_chunk": _mean(totals.encode_ms),
        "random_expectation": _mean(totals.random_expected),
        "drift_share_by_decile": torch.stack(totals.profile).mean(0).tolist() if totals.profile else [],
        "high_drift_in_first15": _mean(totals.early),
        "spearman_lf_drift": _nanmean(totals.spearman_lf),
        "relative_drift_by_layer": {
            "k": torch.stack(totals.rel_k).mean(0).tolist() if totals.rel_k else [],
            "v": torch.stack(totals.rel_v).mean(0).tolist() if totals.rel_v else [],
        },
        "per_example": records,
    }


def format_drift_table(report: dict) -> str:
    """Markdown: Recall@r per ranker, then where drift sits along the chunk."""
    pct = round(100 * report["ratio"])
    lines = [
        f"model {report['model']}, {report['examples']} examples, {report['chunks']} chunks, "
        f"ratio {report['ratio']}, alpha {report['alpha']}",
        "",
    ]
    others = [r for r in report.get("recall_by_ratio", {}) if float(r) != report["ratio"]]
    cost = report.get("offline_cost", {})
    head = f"| ranker | Recall@{pct}% (chunks) | Recall@{pct}% (examples) |"
    head += "".join(f" Recall@{round(100 * float(r))}% |" for r in others)
    head += " offline ms / chunk | x encode |" if cost else ""
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, value in report["recall"].items():
        row = f"| {name} | {value:.3f} | {report['recall_by_example'].get(name, math.nan):.3f} |"
        row += "".join(f" {report['recall_by_ratio'][r].get(name, math.nan):.3f} |" for r in others)
        if cost:
            row += f" {cost[name]['ms_per_chunk']:.1f} | {cost[name]['times_encode']:.2f} |"
        lines.append(row)
    if cost:
        lines.append(f"\nencoding a chunk alone: {report['encode_ms_per_chunk']:.1f} ms on average")
    lines += [
        "",
        f"random expectation {report['random_expectation']:.3f}; "
        f"high-drift tokens in the first 15% of their chunk: {report['high_drift_in_first15']:.3f}; "
        f"Spearman(lf score, drift): {report['spearman_lf_drift']:.3f}",
        "",
        "| decile | " + " | ".join(str(i + 1) for i in range(len(report["drift_share_by_decile"]))) + " |",
        "|---|" + "---|" * len(report["drift_share_by_decile"]),
        "| drift share | " + " | ".join(f"{x:.3f}" for x in report["drift_share_by_decile"]) + " |",
    ]
    return "\n".join(lines)


def plot_drift(report: dict, path: str | Path) -> None:
    """PNG: Recall@r by ranker (with the random expectation) and drift share by position decile."""
    from cachetune.eval.report import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["recall"])
    left.bar(names, [report["recall"][n] for n in names], color="tab:blue")
    left.axhline(report["random_expectation"], color="gray", linestyle="--", label="random expectation")
    left.set_ylim(0, 1)
    left.set_ylabel(f"Recall@{round(100 * report['ratio'])}%")
    left.set_title(f"{report['model']}: high-drift coverage ({report['chunks']} chunks)")
    left.legend()
    shares = report["drift_share_by_decile"]
    right.bar([str(i + 1) for i in range(len(shares))], shares, color="tab:orange")
    right.axhline(1 / max(1, len(shares)), color="gray", linestyle="--", label="uniform")
    right.set_xlabel("relative position in chunk (decile)")
    right.set_ylabel("share of chunk drift")
    right.set_title("where drift sits")
    right.legend()
    save_figure(fig, path)
