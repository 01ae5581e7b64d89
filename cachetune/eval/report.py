"""Summaries of eval records: per dataset and method, as JSON rows, markdown tables and plots."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from cachetune.methods.full_recompute import FULL_RECOMPUTE
from cachetune.eval.metrics import paired_ratio, summarize

METRIC_NAME = {"qa": "f1", "summarization": "rougeL"}
COLUMNS = ["method", "quality", "quality_vs_full", "kl_to_full", "top1_agree", "answer_match_full",
           "ttft_ms_median", "ttft_ms_p95", "speedup_vs_full", "recomputed_share"]
# Shown when the records carry them (eval with gold_nll; reused rows are in every newer record).
OPTIONAL_COLUMNS = ["nll", "gap_closed", "loaded_kib_per_doc_token"]


def summarize_records(records: list[dict], methods: list[str]) -> dict[str, dict]:
    """dataset -> {"task", "metric", "n_examples", "mean_prompt_tokens", "results": [row per method]}.

    quality: mean F1 (QA) or ROUGE-L (summarization) against the gold answers; kl_to_full: mean over
    examples of the mean next-token KL(full || method) along full recompute's answer; top1_agree: over
    all those positions; ttft: median and p95 over every timed request; speedup_vs_full: median TTFT of
    full recompute / median TTFT of the method, both from the same run (for a variant added to resumed
    examples, the full recompute timed in the pass that added it: `full_ttft_ms`).
    """
    by_dataset: dict[str, list[dict]] = {}
    for rec in records:
        by_dataset.setdefault(rec["dataset"], []).append(rec)
    out = {}
    for name, recs in by_dataset.items():
        task = recs[0]["task"]
        full_scores = [r["methods"][FULL_RECOMPUTE]["score"] for r in recs]
        full_quality = statistics.fmean(full_scores)
        rows = []
        for method in methods:
            if not all(method in r["methods"] for r in recs):
                continue
            per = [r["methods"][method] for r in recs]
            ttft = summarize(_pooled(recs, method, "ttft_ms"))
            # A variant added to a resumed example carries the full recompute timed with it.
            full_median = statistics.median(
                x for r in recs
                for x in r["methods"][method].get("full_ttft_ms", r["methods"][FULL_RECOMPUTE]["ttft_ms"])
            )
            quality = statistics.fmean(p["score"] for p in per)
            paired = paired_ratio([p["score"] for p in per], full_scores)
            rows.append({
                "method": method,
                "quality": quality,
                "quality_vs_full": quality / full_quality if full_quality else float("nan"),
                "quality_vs_full_ci": [paired["ci_low"], paired["ci_high"]],
                "examples_better": int(paired["better"]),
                "examples_worse": int(paired["worse"]),
                "kl_to_full": statistics.fmean(p["kl"] for p in per),
                "top1_agree": statistics.fmean(_pooled(recs, method, "top1")),
                "answer_match_full": statistics.fmean(p["match"] for p in per),
                "ttft_ms_median": ttft["median"],
                "ttft_ms_p95": ttft["p95"],
                "speedup_vs_full": full_median / ttft["median"],
                "recomputed_share": statistics.fmean(p["recomputed_share"] for p in per),
                **_optional(recs, method),
            })
        out[name] = {
            "task": task,
            "metric": METRIC_NAME[task],
            "n_examples": len(recs),
            "mean_prompt_tokens": statistics.fmean(r.get("prompt_tokens", 0) for r in recs),
            "results": rows,
        }
    return out


def _optional(recs: list[dict], method: str) -> dict:
    """Gold-answer NLL and the share of the no-context -> full-recompute NLL gap the method closes
    (from mean NLLs: (none - method) / (none - full)); KV loaded per document token (KiB)."""
    out = {}
    per = [r["methods"][method] for r in recs]
    if all("nll" in p for p in per) and all("no_context_nll" in r for r in recs):
        nll = statistics.fmean(p["nll"] for p in per)
        none = statistics.fmean(r["no_context_nll"] for r in recs)
        full = statistics.fmean(r["methods"][FULL_RECOMPUTE]["nll"] for r in recs)
        out.update(nll=nll, no_context_nll=none, gap_closed=(none - nll) / (none - full) if none != full else float("nan"))
    if all("reused_rows" in p for p in per) and all("chunk_tokens" in r for r in recs):
        loaded = sum(p["reused_rows"] * r["kv_bytes_per_row"] for p, r in zip(per, recs))
        out["loaded_kib_per_doc_token"] = loaded / max(1, sum(r["chunk_tokens"] for r in recs)) / 1024
    return out


def _pooled(recs: list[dict], method: str, key: str) -> list[float]:
    return [x for r in recs for x in r["methods"][method][key]]


def format_tables(report: dict) -> str:
    """Markdown: one table per dataset, one row per method."""
    head = (f"model {report['model']} ({report['dtype']}, {report['threads']} threads), "
            f"ratio {report['config']['ratio']}")
    parts = [head]
    for name, ds in report["datasets"].items():
        columns = COLUMNS + [c for c in OPTIONAL_COLUMNS if ds["results"] and all(c in r for r in ds["results"])]
        parts += ["", f"### {name}: {ds['n_examples']} examples, ~{ds['mean_prompt_tokens']:.0f} prompt tokens, "
                      f"quality = {ds['metric']}", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in ds["results"]:
            parts.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
        parts += ["", f"Paired with full recompute on the same {ds['n_examples']} examples ({ds['metric']}):", "",
                  "| method | quality_vs_full | 95% bootstrap interval | examples better / worse |", "|---|---|---|---|"]
        for row in ds["results"]:
            if row["method"] != FULL_RECOMPUTE:
                lo, hi = row["quality_vs_full_ci"]
                parts.append(f"| {row['method']} | {_cell(row['quality_vs_full'])} | {lo:.2f}-{hi:.2f} | "
                             f"{row['examples_better']} / {row['examples_worse']} |")
    return "\n".join(parts)


def _cell(value) -> str:
    if isinstance(value, str):
        return value
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}"


def write_json(data: dict, path: str | Path) -> None:
    """Atomic write: a reader never sees half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (imported on first use: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, title: str | None = None) -> Path:
    """Lay out, write a PNG (creating its folder) and free the figure."""
    plt = pyplot()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tradeoff(report: dict, out_dir: str | Path) -> list[Path]:
    """The paper's Figure 3: quality vs TTFT per dataset, and the same for fidelity (KL to full)."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, fname in [("quality", "quality (F1 / ROUGE-L)", "quality_vs_ttft.png"),
                              ("kl_to_full", "KL to full recompute (lower is better)", "fidelity_vs_ttft.png")]:
        names = list(report["datasets"])
        fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names) + 2, 4.5), squeeze=False)
        for ax, name in zip(axes[0], names):
            ds = report["datasets"][name]
            for i, row in enumerate(ds["results"]):
                # Fixed colour and marker per method position, so methods read the same in every panel.
                ax.scatter([row["ttft_ms_median"] / 1000], [row[key]], s=50, label=row["method"],
                           color=plt.cm.tab20(i % 20), marker="osD^v<>ph*"[i % 10])
            ax.set_xscale("log")
            ax.set_xlabel("TTFT median (s, log scale)")
            ax.set_ylabel(label if key == "kl_to_full" else ds["metric"])
            ax.set_title(f"{name} ({ds['n_examples']} ex.)")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
        title = f"{report['model']} {report['dtype']}, r={report['config']['ratio']}"
        written.append(save_figure(fig, out_dir / fname, title))
    return written


def plot_ratio_curves(report: dict, out_dir: str | Path) -> Path | None:
    """KL to full against the budget r for every method run at several ratios ("name@r" labels);
    methods without a budget (full reuse, EPIC's fixed k) are horizontal lines. None if no such run."""
    rows = {name: ds["results"] for name, ds in report["datasets"].items()}
    if not any("@" in r["method"] for results in rows.values() for r in results):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows) + 2, 4.5), squeeze=False)
    for ax, (name, results) in zip(axes[0], rows.items()):
        curves: dict[str, list[tuple[float, float]]] = {}
        for r in results:
            base, at, ratio = r["method"].partition("@")
            if at:
                curves.setdefault(base, []).append((float(ratio), r["kl_to_full"]))
            elif base != "full_recompute":
                ax.axhline(r["kl_to_full"], linestyle="--", linewidth=1, color="gray")
                ax.annotate(base, (0.01, r["kl_to_full"]), xycoords=("axes fraction", "data"), fontsize=7,
                            color="gray", va="bottom")
        for i, (base, points) in enumerate(curves.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="osD^v<>ph*"[i % 10], color=plt.cm.tab10(i % 10), label=base)
        ax.set_xlabel("recomputed share r")
        ax.set_ylabel("KL to full recompute (lower is better)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return save_figure(fig, Path(out_dir) / "fidelity_vs_ratio.png", f"{report['model']} {report['dtype']}")
