"""Summaries of eval records: per dataset and method, as JSON rows, markdown tables and plots."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from cachetune.atomic import write_text_atomic
from cachetune.config import QUALITY_TARGET
from cachetune.methods.full_recompute import FULL_RECOMPUTE
from cachetune.eval.metrics import bootstrap_mean, paired_ratio, summarize

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
    examples, the full recompute timed in the pass that added it: `full_ttft_ms`). Each row is over
    the examples that have its method (`n_examples`; a sweep's other ratios may cover fewer); a
    method no example has is left out.
    """
    by_dataset: dict[str, list[dict]] = {}
    for rec in records:
        by_dataset.setdefault(rec["dataset"], []).append(rec)
    out = {}
    for name, recs in by_dataset.items():
        task = recs[0]["task"]
        rows = []
        for method in methods:
            have = [r for r in recs if method in r["methods"]]
            if not have:
                continue
            per = [r["methods"][method] for r in have]
            full_scores = [r["methods"][FULL_RECOMPUTE]["score"] for r in have]
            full_quality = statistics.fmean(full_scores)
            ttft = summarize(_pooled(have, method, "ttft_ms"))
            # A variant added to a resumed example carries the full recompute timed with it.
            full_median = statistics.median(
                x for r in have
                for x in r["methods"][method].get("full_ttft_ms", r["methods"][FULL_RECOMPUTE]["ttft_ms"])
            )
            quality = statistics.fmean(p["score"] for p in per)
            paired = paired_ratio([p["score"] for p in per], full_scores)
            rows.append({
                "method": method,
                "n_examples": len(have),
                "quality": quality,
                "quality_vs_full": quality / full_quality if full_quality else float("nan"),
                "quality_vs_full_ci": [paired["ci_low"], paired["ci_high"]],
                "examples_better": int(paired["better"]),
                "examples_worse": int(paired["worse"]),
                "kl_to_full": statistics.fmean(p["kl"] for p in per),
                "kl_to_full_ci": list(bootstrap_mean([p["kl"] for p in per])),
                "quality_ci": list(bootstrap_mean([p["score"] for p in per])),
                "top1_agree": statistics.fmean(_pooled(have, method, "top1")),
                "answer_match_full": statistics.fmean(p["match"] for p in per),
                "ttft_ms_median": ttft["median"],
                "ttft_ms_p95": ttft["p95"],
                "speedup_vs_full": full_median / ttft["median"],
                "recomputed_share": statistics.fmean(p["recomputed_share"] for p in per),
                **_optional(have, method),
            })
        out[name] = {
            "task": task,
            "metric": METRIC_NAME[task],
            "n_examples": len(recs),
            "mean_prompt_tokens": statistics.fmean(r.get("prompt_tokens", 0) for r in recs),
            "results": rows,
        }
    return out


def sweep_records(records: list[dict], labels: list[str]) -> list[dict]:
    """The records that ran every one of `labels`: where a frontier compares variants on the same examples."""
    return [r for r in records if all(label in r["methods"] for label in labels)]


def paired_comparison(records: list[dict], method: str, other: str, timing_base: str) -> dict | None:
    """`method` against `other`, paired per example on the records that have both, `timing_base` and
    full recompute; None when none has. Labels are as in the records (a sweep's carry "@<ratio>").

    kl_diff: mean of per-example KL(method) - KL(other) with its 95% bootstrap interval (examples
    resampled), and how many examples each wins; top1: each one's mean per-example share of answer
    positions whose argmax agrees with full recompute's, and the paired difference with its interval;
    quality: each one's mean over full recompute's (paired_ratio); ttft: the geometric mean of
    per-example median-TTFT ratios to `timing_base`, with an interval for `method`'s. A per-example
    ratio pairs two requests on the same prompt, so one long prompt does not weigh more than the
    rest; a variant added to a resumed example was timed in another pass, so each side is first
    taken over the full recompute timed in its own pass (`full_ttft_ms`), which cancels when both
    ran in one pass.
    """
    names = (method, other, timing_base, FULL_RECOMPUTE)
    have = [r for r in records if all(n in r["methods"] for n in names)]
    if not have:
        return None
    a, b, base, full = ([r["methods"][n] for r in have] for n in names)
    kl_a, kl_b = np.array([x["kl"] for x in a]), np.array([x["kl"] for x in b])
    top1_a, top1_b = (np.array([statistics.fmean(x["top1"]) for x in per]) for per in (a, b))
    full_scores = [x["score"] for x in full]

    def over_own_full(x: dict, f: dict) -> float:
        return statistics.median(x["ttft_ms"]) / statistics.median(x.get("full_ttft_ms", f["ttft_ms"]))

    def log_ttft(per: list[dict]) -> np.ndarray:
        return np.log([over_own_full(x, f) / over_own_full(y, f) for x, y, f in zip(per, base, full)])

    log_a = log_ttft(a)
    return {
        "n_examples": len(have),
        "kl": float(kl_a.mean()), "other_kl": float(kl_b.mean()),
        "kl_diff": float((kl_a - kl_b).mean()), "kl_diff_ci": list(bootstrap_mean(list(kl_a - kl_b))),
        "wins": int((kl_a < kl_b).sum()), "other_wins": int((kl_a > kl_b).sum()),
        "top1": float(top1_a.mean()), "other_top1": float(top1_b.mean()),
        "top1_diff": float((top1_a - top1_b).mean()), "top1_diff_ci": list(bootstrap_mean(list(top1_a - top1_b))),
        "quality_vs_full": paired_ratio([x["score"] for x in a], full_scores),
        "other_quality_vs_full": paired_ratio([x["score"] for x in b], full_scores),
        "ttft_vs_base": float(np.exp(log_a.mean())),
        "ttft_vs_base_ci": [float(np.exp(v)) for v in bootstrap_mean(list(log_a))],
        "other_ttft_vs_base": float(np.exp(log_ttft(b).mean())),
    }


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


def covers_all(row: dict, ds: dict) -> bool:
    """Whether a method's row is over every example of its dataset (a sweep's other ratios may not be)."""
    return row.get("n_examples", ds["n_examples"]) == ds["n_examples"]


def format_tables(report: dict) -> str:
    """Markdown: one table per dataset, one row per method."""
    head = (f"model {report['model']} ({report['dtype']}, {report['threads']} threads), "
            f"ratio {report['config']['ratio']}")
    parts = [head]
    for name, ds in report["datasets"].items():
        columns = COLUMNS + [c for c in OPTIONAL_COLUMNS if ds["results"] and all(c in r for r in ds["results"])]
        if not all(covers_all(r, ds) for r in ds["results"]):
            columns = columns + ["n_examples"]  # a sweep's other ratios ran on fewer examples
        parts += ["", f"### {name}: {ds['n_examples']} examples, ~{ds['mean_prompt_tokens']:.0f} prompt tokens, "
                      f"quality = {ds['metric']}", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in ds["results"]:
            parts.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
        parts += ["", f"95% bootstrap intervals over each row's examples; quality paired with full "
                      f"recompute ({ds['metric']}):", "",
                  "| method | kl_to_full | interval | quality | interval | quality_vs_full | interval | "
                  "examples better / worse |", "|---|---|---|---|---|---|---|---|"]
        for row in ds["results"]:
            if row["method"] != FULL_RECOMPUTE:
                parts.append(f"| {row['method']} | {_cell(row['kl_to_full'])} | {_span(row.get('kl_to_full_ci'))} | "
                             f"{_cell(row['quality'])} | {_span(row.get('quality_ci'))} | "
                             f"{_cell(row['quality_vs_full'])} | {_span(row['quality_vs_full_ci'], 2)} | "
                             f"{row['examples_better']} / {row['examples_worse']} |")
        # The frontier compares every variant on the same examples (report["frontier"], when given).
        # Without it, the rows that cover every example: a sweep's rows on fewer are not comparable.
        sweep = report.get("frontier", {}).get(name, ds)
        points = {r["method"]: (r["ttft_ms_median"], r["kl_to_full"]) for r in sweep["results"]
                  if r["method"] != FULL_RECOMPUTE and covers_all(r, sweep)}
        if any("@" in m for m in points):
            front = pareto_frontier(points)
            parts += ["", f"KL Pareto frontier over the {sweep['n_examples']} examples every variant ran on, "
                          "fastest first (median TTFT ms, KL): " + " -> ".join(
                f"{m} ({points[m][0]:.0f}, {points[m][1]:.3f})" for m in front)]
    return "\n".join(parts)


def _cell(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):  # a count
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}"


def _span(interval, digits: int = 3) -> str:
    """"lo-hi" of a bootstrap interval (reports written before intervals were kept: blank)."""
    if not interval:
        return ""
    lo, hi = interval
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def write_json(data: dict, path: str | Path) -> None:
    """Atomic write: a reader never sees half a report."""
    write_text_atomic(path, json.dumps(data, indent=2))


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


def legend_inches(labels: list[str], fontsize: float) -> float:
    """Figure width (inches) a legend right of the axes takes: about 0.65 em a character plus the
    marker. Added to the panels' width, so long method names do not squeeze the axes."""
    return 0.65 * fontsize / 72 * max((len(label) for label in labels), default=0) + 0.8


def plot_tradeoff(report: dict, out_dir: str | Path) -> list[Path]:
    """The paper's Figure 3: quality vs TTFT per dataset, and the same for fidelity (KL to full)."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, fname in [("quality", "quality (F1 / ROUGE-L)", "quality_vs_ttft.png"),
                              ("kl_to_full", "KL to full recompute (lower is better)", "fidelity_vs_ttft.png")]:
        names = list(report["datasets"])
        labels = [row["method"] for ds in report["datasets"].values() for row in ds["results"]]
        fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names) + legend_inches(labels, 8), 4.5),
                                 squeeze=False)
        for ax, name in zip(axes[0], names):
            ds = report["datasets"][name]
            for i, row in enumerate(ds["results"]):
                if not covers_all(row, ds):  # the panel compares methods on the same examples
                    continue
                # Fixed colour and marker per method position, so methods read the same in every panel
                # (the marker shifts each 20, so no two of 200 share both).
                ax.scatter([row["ttft_ms_median"] / 1000], [row[key]], s=50, label=row["method"],
                           color=plt.cm.tab20(i % 20), marker="osD^v<>ph*"[(i + i // 20) % 10])
            ax.set_xscale("log")
            ax.set_xlabel("TTFT median (s, log scale)")
            ax.set_ylabel(label if key == "kl_to_full" else ds["metric"])
            ax.set_title(f"{name} ({ds['n_examples']} ex.)")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
        title = f"{report['model']} {report['dtype']}, r={report['config']['ratio']}"
        written.append(save_figure(fig, out_dir / fname, title))
    return written


def ratio_curves(results: list[dict], ratio: float | None = None
                 ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """A dataset's rows as (r, KL to full) points per method run at several ratios ("name@r"), sorted
    by r, and the KL of every other method but full recompute (a horizontal line). A bare label whose
    method also ran at other ratios is its point at `ratio`, the run's own budget."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        base, at, share = r["method"].partition("@")
        if at:
            curves.setdefault(base, []).append((float(share), r["kl_to_full"]))
    lines = {}
    for r in results:
        name = r["method"]
        if "@" in name or name == "full_recompute":
            continue
        if name in curves and ratio is not None:
            curves[name].append((ratio, r["kl_to_full"]))
        else:
            lines[name] = r["kl_to_full"]
    return {base: sorted(points) for base, points in curves.items()}, lines


def plot_ratio_curves(report: dict, out_dir: str | Path) -> Path | None:
    """KL to full against the budget r for every method run at several ratios ("name@r" labels, and
    its bare label at the run's ratio); methods without a budget (full reuse, EPIC's fixed k) are
    horizontal lines; rows on fewer examples than their dataset's are left out. None if no such run."""
    rows = {name: [r for r in ds["results"] if covers_all(r, ds)] for name, ds in report["datasets"].items()}
    if not any("@" in r["method"] for results in rows.values() for r in results):
        return None
    plt = pyplot()
    ratio = report.get("config", {}).get("ratio")
    labels = [r["method"].partition("@")[0] for results in rows.values() for r in results]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows) + legend_inches(labels, 8), 4.5),
                             squeeze=False)
    for ax, (name, results) in zip(axes[0], rows.items()):
        curves, lines = ratio_curves(results, ratio)
        for base, kl in lines.items():
            ax.axhline(kl, linestyle="--", linewidth=1, color="gray")
            ax.annotate(base, (0.01, kl), xycoords=("axes fraction", "data"), fontsize=7, color="gray",
                        va="bottom")
        for i, (base, points) in enumerate(curves.items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="osD^v<>ph*"[i % 10], color=plt.cm.tab10(i % 10), label=base)
        ax.set_xlabel("recomputed share r")
        ax.set_ylabel("KL to full recompute (lower is better)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return save_figure(fig, Path(out_dir) / "fidelity_vs_ratio.png", f"{report['model']} {report['dtype']}")


def pareto_frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """Labels of the points no other point beats on both cost and loss (lower is better for both),
    cheapest first. points: label -> (cost, loss), e.g. (TTFT, KL to full)."""
    best = float("inf")
    out = []
    for label, (cost, loss) in sorted(points.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if loss < best:
            out.append(label)
            best = loss
    return out


def best_within(points: dict[str, tuple[float, float]], budget: float) -> str | None:
    """The label with the lowest loss among points that cost at most `budget` (None: none does)."""
    fits = [(loss, cost, label) for label, (cost, loss) in points.items() if cost <= budget]
    return min(fits)[2] if fits else None


def _minor_tick_label(x: float, _pos) -> str:
    """Log-axis minor ticks labelled at 2x and 5x a power of ten only (all of them overlap)."""
    if x <= 0:
        return ""
    lead = x / 10 ** math.floor(math.log10(x))
    return f"{x:g}" if round(lead) in (2, 5) and abs(lead - round(lead)) < 1e-6 else ""


def plot_frontier(report: dict, out_dir: str | Path, mark: str | None = None) -> list[Path]:
    """Per dataset, KL to full and quality against median TTFT: one line per method across its
    ratios ("name@r" labels, r written beside each point), single points for methods without a
    budget, and each panel's Pareto frontier over all of them drawn and circled. `mark` is the label of one
    variant (the engine's default) drawn as a star. One PNG per dataset: frontier_<dataset>.png."""
    plt = pyplot()
    written = []
    for name, ds in report["datasets"].items():
        rows = [r for r in ds["results"] if r["method"] != FULL_RECOMPUTE]
        labels = [r["method"].partition("@")[0] for r in rows] + ["frontier", "the default"]
        fig, axes = plt.subplots(1, 2, figsize=(11 + legend_inches(labels, 7), 5))
        for ax, key, ylabel, sign in [(axes[0], "kl_to_full", "KL to full recompute (lower is better)", 1.0),
                                      (axes[1], "quality", f"{ds['metric']} (higher is better)", -1.0)]:
            curves: dict[str, list[tuple[float, float, str]]] = {}
            for r in rows:
                base, _, ratio = r["method"].partition("@")
                curves.setdefault(base, []).append((r["ttft_ms_median"] / 1000, r[key], ratio))
            for i, (base, pts) in enumerate(curves.items()):
                pts.sort()
                xs, ys, rs = zip(*pts)
                style = "-" if len(pts) > 1 else ""
                ax.plot(xs, ys, style, marker="osD^v<>ph*"[i % 10], color=plt.cm.tab20(i % 20), label=base,
                        markersize=6, linewidth=1.2)
                for x, y, rr in pts:
                    if rr:
                        ax.annotate(rr, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            # This panel's own frontier: lower KL, or higher quality, at no more TTFT.
            points = {r["method"]: (r["ttft_ms_median"] / 1000, sign * r[key]) for r in rows}
            fx = sorted((points[m][0], sign * points[m][1]) for m in pareto_frontier(points))
            ax.plot(*zip(*fx), color="black", linewidth=2.5, alpha=0.25, label="frontier")
            ax.scatter(*zip(*fx), s=140, facecolors="none", edgecolors="black", linewidths=1.2)
            for r in rows:
                if r["method"] == mark:
                    ax.scatter([r["ttft_ms_median"] / 1000], [r[key]], marker="*", s=260, color="gold",
                               edgecolors="black", zorder=5, label="the default")
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(plt.FuncFormatter(_minor_tick_label))
            ax.set_xlabel("TTFT median (s, log scale)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        title = f"{report['model']} {report['dtype']}, {name} ({ds['n_examples']} ex.)"
        written.append(save_figure(fig, Path(out_dir) / f"frontier_{name.replace('/', '_')}.png", title))
    return written


def chunk_length_of(dataset: str) -> tuple[str, int] | None:
    """("musique", 128) for a set re-chunked by `cachetune eval --chunk-tokens` ("musique@128t"), else None."""
    base, at, length = dataset.rpartition("@")
    if not at or not length.endswith("t") or not length[:-1].isdigit():
        return None
    return base, int(length[:-1])


def by_chunk_length(report: dict) -> dict[str, list[dict]]:
    """Set -> one row per (method, chunk length) of its re-chunked datasets, lengths ascending: quality
    and its ratio to full recompute (with the paired interval), KL, answer agreement, TTFT, speedup."""
    out: dict[str, list[dict]] = {}
    keys = ("quality", "quality_vs_full", "quality_vs_full_ci", "kl_to_full", "answer_match_full",
            "ttft_ms_median", "speedup_vs_full", "n_examples")
    for name, ds in report["datasets"].items():
        found = chunk_length_of(name)
        if found is None:
            continue
        base, length = found
        for row in ds["results"]:
            out.setdefault(base, []).append({"method": row["method"], "chunk_tokens": length,
                                             **{k: row[k] for k in keys}})
    for rows in out.values():
        rows.sort(key=lambda r: (r["chunk_tokens"], r["method"]))
    return out


def quality_floors(report: dict, method: str = "cachetune", target: float = QUALITY_TARGET) -> dict[int, float | None]:
    """Chunk length -> the least ratio at which `method` (its plain label at the run's ratio and its
    `method@r` variants) kept quality at `target` of full recompute's on every re-chunked set that ran
    it; None where no ratio measured did. What "auto"'s floor by chunk length (length_floors) is
    learned from."""
    kept: dict[int, dict[float, bool]] = {}
    for rows in by_chunk_length(report).values():
        for row in rows:
            base, at, text = row["method"].partition("@")
            if base != method or row["quality_vs_full"] is None:
                continue
            ratio = float(text) if at else report["config"]["ratio"]
            ratios = kept.setdefault(row["chunk_tokens"], {})
            ratios[ratio] = ratios.get(ratio, True) and row["quality_vs_full"] >= target
    return {length: min((r for r, ok in ratios.items() if ok), default=None) for length, ratios in sorted(kept.items())}


def format_quality_floors(floors: dict[int, float | None], method: str = "cachetune",
                          target: float = QUALITY_TARGET) -> str:
    """One markdown line: the floors as an EngineConfig.length_floors value, and the lengths where no
    ratio measured kept the target."""
    found = ",".join(f"{length}:{ratio:g}" for length, ratio in floors.items() if ratio is not None)
    missed = [str(length) for length, ratio in floors.items() if ratio is None]
    line = (f"Least ratio at which {method} kept {target:.0%} of full recompute's quality at each chunk length: "
            f"`--length-floors '{found}'`")
    return line + (f" (none measured kept it at {', '.join(missed)} tokens)" if missed else "")


def format_by_length(rows_by_set: dict[str, list[dict]]) -> str:
    """Markdown: per set, one row per method and chunk length."""
    parts = []
    for name, rows in rows_by_set.items():
        parts += ["", f"### {name}, by chunk length", "",
                  "| chunk tokens | method | n | quality | vs full | interval | KL | answer = full | TTFT ms | speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            parts.append(f"| {r['chunk_tokens']} | {r['method']} | {r['n_examples']} | {_cell(r['quality'])} | "
                         f"{_cell(r['quality_vs_full'])} | {_span(r['quality_vs_full_ci'], 2)} | "
                         f"{_cell(r['kl_to_full'])} | {_cell(r['answer_match_full'])} | "
                         f"{_cell(r['ttft_ms_median'])} | {_cell(r['speedup_vs_full'])} |")
    return "\n".join(parts).lstrip("\n")


def plot_quality_by_length(report: dict, out_dir: str | Path) -> Path | None:
    """Quality over full recompute's (paired 95% interval as error bars) and KL against chunk length,
    one line per method, one column per set: quality_by_chunk_length.png. None without re-chunked sets."""
    rows_by_set = by_chunk_length(report)
    if not rows_by_set:
        return None
    plt = pyplot()
    methods = list(dict.fromkeys(r["method"] for rows in rows_by_set.values() for r in rows
                                 if r["method"] != FULL_RECOMPUTE))
    fig, axes = plt.subplots(2, len(rows_by_set), figsize=(5 * len(rows_by_set) + legend_inches(methods, 8), 8),
                             squeeze=False)
    for column, (name, rows) in enumerate(rows_by_set.items()):
        top, bottom = axes[0][column], axes[1][column]
        for i, method in enumerate(methods):
            mine = [r for r in rows if r["method"] == method]
            if not mine:
                continue
            xs = [r["chunk_tokens"] for r in mine]
            ys = [r["quality_vs_full"] for r in mine]
            low = [max(0.0, y - r["quality_vs_full_ci"][0]) for y, r in zip(ys, mine)]
            high = [max(0.0, r["quality_vs_full_ci"][1] - y) for y, r in zip(ys, mine)]
            style = {"marker": "osD^v<>ph*"[i % 10], "color": plt.cm.tab10(i % 10), "label": method}
            top.errorbar(xs, ys, yerr=[low, high], capsize=3, linewidth=1.2, **style)
            bottom.plot(xs, [r["kl_to_full"] for r in mine], linewidth=1.2, **style)
        top.axhline(1.0, color="black", linewidth=1, alpha=0.4)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["chunk_tokens"] for r in rows}))
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_xlabel("chunk length (tokens)")
            ax.grid(alpha=0.3)
        top.set_title(name)
        top.set_ylabel("quality / full recompute's")
        bottom.set_ylabel("KL to full recompute")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return save_figure(fig, Path(out_dir) / "quality_by_chunk_length.png",
                       f"{report['model']} {report['dtype']}, quality against chunk length")
