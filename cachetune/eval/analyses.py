"""The paper's analyses that run through the eval harness (drift and spectrum live in their own files).

- `sweep`: cachetune at r in RATIOS (alpha 0.5), and the LF ranking at alpha in ALPHAS (r 0.15):
  quality, fidelity and TTFT per point (paper Figure 11).
- `robustness`: rankings frozen at caching time, served in five settings: dataset order, chunks
  shuffled, 1,024 tokens of unrelated uncached text before the chunks, both, and another example's
  question over the same documents (Figure 1c), for full reuse and the chosen rankers at r = 0.15.
- `attention_similarity`: cosine between the question's attention over the prompt under a method and
  under full recompute, per layer averaged, for full reuse and LF / high-frequency / random selection,
  with the first n documents for several n (Figure 1a).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from cachetune.chunks.ranking import top_share
from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.datasets import QAExample
from cachetune.eval.harness import TASK_SYSTEM, Setting, Variant
from cachetune.eval.report import pyplot, save_figure
from cachetune.methods.full_recompute import FULL_RECOMPUTE
from cachetune.runtime.prefill import selective_prefill
from cachetune.methods.signals import QuestionAttention

RATIOS = (0.05, 0.10, 0.15, 0.20, 0.30, 0.40)
ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
ROBUSTNESS_SETTINGS = (
    Setting("order"),
    Setting("shuffled", shuffle=True),
    Setting("preamble1024", preamble_tokens=1024),
    Setting("shuffled+preamble1024", shuffle=True, preamble_tokens=1024),
    Setting("other_question", other_question=True),
)
SELECTIONS = {"lowfreq": "lf", "highfreq": "highfreq", "random": "random"}
ROBUSTNESS_RANKERS = ("lf", "highfreq", "random")
FULL = Variant(FULL_RECOMPUTE, FULL_RECOMPUTE, 1.0)


# These analyses are about offline rankings: each chunk's top r by the ranking alone (no signal).
OFFLINE = ":allocation=proportional:signal=none"


def sweep_variants(ratios=RATIOS, alphas=ALPHAS, alpha_ratio: float = EngineConfig.ratio) -> list[Variant]:
    out = [FULL]
    out += [Variant(f"r={r:g}", "cachetune" + OFFLINE, r) for r in ratios]
    out += [Variant(f"alpha={a:g}", f"cachetune:lf:{a:g}{OFFLINE}", alpha_ratio) for a in alphas]
    return out


def robustness_variants(ratio: float = EngineConfig.ratio, rankers=ROBUSTNESS_RANKERS) -> list[Variant]:
    out = [FULL, Variant("full_reuse", "full_reuse", 0.0)]
    return out + [Variant(f"cachetune:{r}", f"cachetune:{r}{OFFLINE}", ratio) for r in rankers]


def plot_sweep(report: dict, path: str | Path) -> Path:
    """Quality and KL against r (with TTFT) and against alpha, one line per dataset."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, ds in report["datasets"].items():
        rows = {r["method"]: r for r in ds["results"]}
        r_rows = sorted((float(k[2:]), v) for k, v in rows.items() if k.startswith("r="))
        a_rows = sorted((float(k[6:]), v) for k, v in rows.items() if k.startswith("alpha="))
        full = rows[FULL_RECOMPUTE]
        line = axes[0].plot([x for x, _ in r_rows], [v["quality"] for _, v in r_rows], "o-", label=f"{name}")[0]
        axes[0].axhline(full["quality"], ls="--", color=line.get_color(), alpha=0.6)
        axes[1].plot([x for x, _ in r_rows], [v["kl_to_full"] for _, v in r_rows], "o-", label=f"{name} KL")
        twin = axes[1].twinx()
        twin.plot([x for x, _ in r_rows], [v["ttft_ms_median"] / 1000 for _, v in r_rows], "s:", color="gray")
        twin.set_ylabel("TTFT median (s), dotted")
        axes[2].plot([x for x, _ in a_rows], [v["kl_to_full"] for _, v in a_rows], "o-", label=f"{name}")
    axes[0].set(xlabel="r (alpha 0.5)", ylabel="quality (dashed: full recompute)", title="quality vs r")
    axes[1].set(xlabel="r (alpha 0.5)", ylabel="KL to full", title="fidelity and TTFT vs r")
    axes[2].set(xlabel="alpha (r 0.15)", ylabel="KL to full", title="fidelity vs alpha")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, report['model'])


def plot_robustness(report: dict, path: str | Path) -> Path:
    """Grouped bars: KL to full (and quality) per layout setting and selection."""
    plt = pyplot()
    names = list(report["datasets"])
    methods = [r["method"] for r in report["datasets"][names[0]]["results"] if r["method"] != FULL_RECOMPUTE]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / max(len(methods), 1)
    for j, method in enumerate(methods):
        for ax, key in zip(axes, ("kl_to_full", "quality")):
            ys = [next(r[key] for r in report["datasets"][n]["results"] if r["method"] == method) for n in names]
            ax.bar([i + j * width for i in range(len(names))], ys, width, label=method)
    for ax, key in zip(axes, ("KL to full recompute (lower is better)", "quality")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
        ax.set_xticklabels([n.split("/")[-1] for n in names], fontsize=8)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    return save_figure(fig, path, report['model'])


# ---- attention similarity (Figure 1a) ---------------------------------------------------------


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@torch.no_grad()
def attention_similarity(engine: Engine, examples: list[QAExample], chunk_counts=(2, 5, 10),
                         ratio: float = EngineConfig.ratio, progress: bool = True) -> dict:
    """Per method and number of chunks: mean over examples and layers of cos(attn_method, attn_full)."""
    methods = {"full_reuse": None, **SELECTIONS}
    sims: dict[str, dict[int, list[float]]] = {m: {n: [] for n in chunk_counts} for m in methods}
    for ex in tqdm(examples, desc="attention", disable=not progress):
        ids = [engine.cache_document(doc) for doc in ex.documents]
        for n in chunk_counts:
            layout = engine.build_prompt(ids[:n], ex.question, TASK_SYSTEM[ex.task])
            chunks = [seg.chunk for _, seg in layout.chunk_segments]
            reference = _question_attention(engine, layout, [torch.arange(c.num_tokens) for c in chunks])
            for method, ranker in methods.items():
                if ranker is None:
                    sel = [torch.empty(0, dtype=torch.int64) for _ in chunks]
                else:
                    sel = [top_share(engine.rankings.ranking(c, ranker), ratio) for c in chunks]
                got = _question_attention(engine, layout, sel)
                sims[method][n].append(statistics.fmean(_cosine(a, b) for a, b in zip(reference, got)))
    return {
        "model": engine.name, "ratio": ratio, "n_examples": len(examples), "chunk_counts": list(chunk_counts),
        "definition": "cosine over key positions of the question's attention (softmax, averaged over heads "
                      "and question tokens) under the method vs full recompute, averaged over layers",
        "cosine": {m: {str(n): statistics.fmean(v) for n, v in per.items() if v} for m, per in sims.items()},
    }


def _question_attention(engine: Engine, layout, selections) -> list[torch.Tensor]:
    observer = QuestionAttention(engine.adapter, layout)
    selective_prefill(engine.adapter, layout, selections, layout.total, observe=observer)
    return observer.per_layer


def format_attention_table(report: dict) -> str:
    counts = report["chunk_counts"]
    lines = [f"question-attention cosine to full recompute, {report['model']}, r={report['ratio']}, "
             f"{report['n_examples']} examples", "",
             "| method | " + " | ".join(f"{n} chunks" for n in counts) + " |", "|---|" + "---|" * len(counts)]
    for method, per in report["cosine"].items():
        lines.append(f"| {method} | " + " | ".join(f"{per.get(str(n), float('nan')):.4f}" for n in counts) + " |")
    return "\n".join(lines)


def plot_attention(report: dict, path: str | Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method, per in report["cosine"].items():
        xs = [int(n) for n in per]
        ax.plot(xs, list(per.values()), "o-", label=method)
    ax.set(xlabel="number of chunks", ylabel="cosine to full recompute's attention",
           title="question attention vs full recompute")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, report['model'])
