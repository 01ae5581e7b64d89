"""`cachetune bench-calibrate`: fixed against calibrated recompute ratios per tier (paper Table 5,
Figure 10), and the cost model's predictions against measured TTFT.

Per tier (the chunks stored in that tier alone, read from it):
1. calibrate (tuning.calibrate: profile, cost model, warm-started golden-section search);
2. sweep: measured TTFT at every ratio of `sweep`, beside the model's pipelined and sequential
   predictions from a profile measured alongside (interleaved with the sweep, so the machine's
   drift in speed over minutes hits both alike), and the pipelined one from the calibration's own
   profile (minutes earlier);
3. compare on the same prompts, interleaved: full recompute, fixed r = `fixed_ratio` and the
   calibrated r (median TTFT, speedups over full recompute, KL of the next-token distribution to
   full recompute's).

Tiers: `cpu`, `disk` (a real folder; its page cache dropped before every timed read), any throttled
disk (`disk@hdd`, `disk@ssd`, `disk@60MB/s+5ms`) and `slow`: a disk throttled to half the
bandwidth at which loading the reuse complement at r_min takes as long as its compute, computed
from the first tier's profile, so loading loses to recompute there.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from cachetune.config import QUALITY_FLOOR, EngineConfig, parse_tiers
from cachetune.engine.engine import Engine
from cachetune.eval.bench_batch import example_prompt
from cachetune.eval.datasets import QAExample
from cachetune.eval.metrics import kl_to_reference
from cachetune.eval.report import pyplot, save_figure
from cachetune.model.adapter import ModelAdapter
from cachetune.model.loader import LoadedModel
from cachetune.tuning.calibrate import CalibrationConfig, calibrate, cold_reads, prefill_seconds
from cachetune.tuning.cost import Profile, PromptShape, mean_ttft
from cachetune.tuning.profile import (fit_profile, load_and_compute, pipelined, profile_sample, prompt_shape,
                                      top_selections)

SLOW = "slow"
DEFAULT_TIERS = ("cpu", "disk", "disk@ssd", "disk@hdd", SLOW)


@dataclass(frozen=True)
class CalibrationBenchConfig:
    tiers: tuple[str, ...] = DEFAULT_TIERS
    sweep: tuple[float, ...] = (0.0, 0.15, 0.3, 0.5, 0.75, 1.0)
    fixed_ratio: float = QUALITY_FLOOR
    repeats: int = 3          # timed runs per prompt and point (sweep, comparison); the median drops an outlier
    calibration: CalibrationConfig = CalibrationConfig()

    def __post_init__(self) -> None:
        for tier in self.tiers:
            if tier != SLOW:
                parse_tiers(tier)  # raises with the bad part named
        if self.tiers and self.tiers[0] == SLOW:
            raise ValueError("the slow tier's bandwidth comes from an earlier tier's profile: list one first")


def crossover_bandwidth(profile: Profile, shapes: list[PromptShape], ratio: float, row_bytes: int) -> float:
    """Bytes/s at which one layer's reuse complement at `ratio` reads in the time the layer computes
    (median over prompts): below it, loading is the critical path at that ratio."""
    return statistics.median(s.reused(ratio) * row_bytes / profile.compute_s(s, ratio) for s in shapes)


def tier_engine(loaded: LoadedModel, config: EngineConfig, spec: str, folder: Path) -> Engine:
    """An engine over `loaded` whose store is tier `spec` alone, a disk tier in `folder`."""
    tier = parse_tiers(spec)[0]
    if tier.kind == "disk" and tier.path is None:
        spec = f"disk:{folder}" + (f"@{tier.throttle}" if tier.throttle else "")
    return Engine(loaded, replace(config, tiers=spec, self_check=False))


def _max_error(sweep: list[dict], key: str) -> float:
    return max(abs(p[key] / p["measured_s"] - 1) for p in sweep)


def _sweep(engine: Engine, layouts, cfg: CalibrationBenchConfig, before, desc: str, progress: bool
           ) -> tuple[list[dict], Profile]:
    """Measured TTFT at every sweep ratio (mean over prompts of the median over repeats), and a
    profile re-measured alongside (its samples interleaved with the sweep's runs), so that slow
    drift of the machine's speed hits the measurement and the profile alike."""
    ratios = cfg.calibration.profile_ratios
    ttft = {r: [[] for _ in layouts] for r in cfg.sweep}
    parts = {r: [[] for _ in layouts] for r in ratios}
    bar = tqdm(total=cfg.repeats * len(layouts) * (len(cfg.sweep) + len(ratios)), desc=desc, disable=not progress)
    for _ in range(cfg.repeats):
        for i, layout in enumerate(layouts):
            for r in cfg.sweep:
                ttft[r][i].append(prefill_seconds(engine, layout, cfg.calibration.method, r, before))
                bar.update(1)
            for r in ratios:
                parts[r][i].append(load_and_compute(engine, layout, top_selections(layout, r), before))
                bar.update(1)
    bar.close()
    samples = [profile_sample(layout, r, parts[r][i]) for i, layout in enumerate(layouts) for r in ratios]
    alongside = fit_profile(samples, engine.adapter.num_layers, pipelined(engine, layouts))
    sweep = [{"ratio": r, "measured_s": statistics.mean(statistics.median(p) for p in ttft[r])} for r in cfg.sweep]
    return sweep, alongside


def _compare(engine: Engine, layouts, ratios: dict[str, float], repeats: int, before) -> dict:
    """Median TTFT (s) per prompt of full recompute and each named ratio, interleaved; KL to full."""
    names = ["full_recompute", *ratios]
    runs = {n: [[] for _ in layouts] for n in names}
    for _ in range(repeats):
        for i, layout in enumerate(layouts):
            runs["full_recompute"][i].append(prefill_seconds(engine, layout, "full_recompute", 1.0, before))
            for name, r in ratios.items():
                runs[name][i].append(prefill_seconds(engine, layout, "cachetune", r, before))
    out = {n: {"ttft_s": statistics.median(statistics.median(p) for p in runs[n])} for n in names}
    full = [engine.prefill(layout, "full_recompute").logits[None] for layout in layouts]
    for name, r in ratios.items():
        kls = [float(kl_to_reference(ref, engine.prefill(layout, "cachetune", r).logits[None]).mean())
               for ref, layout in zip(full, layouts)]
        out[name].update(ratio=r, kl=statistics.mean(kls),
                         speedup=out["full_recompute"]["ttft_s"] / out[name]["ttft_s"])
    return out


def _done_tiers(path: Path | None, setup: dict) -> dict[str, dict]:
    """Rows of tiers an earlier run of the same setup finished (its progress file), by tier."""
    if path is None or not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if isinstance(record, dict) and record.get("setup") == setup:
            done[record["row"]["tier"]] = record["row"]
    return done


def run_bench_calibrate(loaded: LoadedModel, config: EngineConfig, examples: list[QAExample],
                        cfg: CalibrationBenchConfig, documents: int = 0, progress: bool = True,
                        progress_file: str | Path | None = None) -> dict:
    """Every tier of `cfg` on `examples` (their first `documents` documents; 0: all); JSON-ready.
    With `progress_file`, each finished tier is appended there and a rerun of the same setup
    starts after the tiers it holds."""
    rows, profile0, shapes0 = [], None, None
    cal = cfg.calibration
    progress_file = Path(progress_file) if progress_file is not None else None
    setup = json.loads(json.dumps({"config": asdict(cfg), "documents": documents, "model": loaded.name,
                                   "dtype": config.dtype, "examples": [ex.id for ex in examples]}))
    done = _done_tiers(progress_file, setup)
    _, kv_heads, head_dim = ModelAdapter(loaded.model).kv_shape
    row_bytes = 2 * kv_heads * head_dim * config.torch_dtype.itemsize  # one row of one layer, K and V
    with tempfile.TemporaryDirectory(prefix="cachetune-calibrate-") as tmp:
        for n, tier in enumerate(cfg.tiers):
            if tier in done:
                rows.append(done[tier])
                if profile0 is None:
                    profile0 = Profile(**done[tier]["calibration"]["profile"])
                    shapes0 = [PromptShape(t, tuple(c)) for t, c in done[tier]["shapes"]]
                continue
            spec, note = tier, ""
            if tier == SLOW:
                cross = crossover_bandwidth(profile0, shapes0, cal.min_ratio, row_bytes)
                mbps = max(1, math.floor(cross / 2 / 1e6))
                spec, note = f"disk@{mbps}MB/s", f"half the {cross / 1e6:.0f} MB/s at which loading at r_min " \
                                                 f"takes as long as compute"
            engine = tier_engine(loaded, config, spec, Path(tmp) / f"tier{n}")
            layouts = [example_prompt(engine, ex, documents) for ex in examples]
            before = cold_reads(engine)
            report = calibrate(engine, layouts, cal, progress)
            profile = Profile(**report["profile"])
            shapes = [prompt_shape(layout) for layout in layouts]
            if profile0 is None:
                profile0, shapes0 = profile, shapes
            sweep, alongside = _sweep(engine, layouts, cfg, before, f"sweep {tier}", progress)
            for point in sweep:
                r = point["ratio"]
                point.update(predicted_s=mean_ttft(alongside, shapes, r),
                             sequential_s=mean_ttft(alongside, shapes, r, pipelined=False),
                             calibration_predicted_s=mean_ttft(profile, shapes, r))
            compare = _compare(engine, layouts, {"fixed": cfg.fixed_ratio, "calibrated": report["ratio"]},
                               cfg.repeats, before)
            rows.append({"tier": tier, "spec": spec, "label": report["tier"], "note": note,
                         "calibration": report, "sweep": sweep, "compare": compare,
                         "sweep_profile": alongside.to_dict(), "shapes": [[s.tokens, list(s.chunks)] for s in shapes],
                         "max_prediction_error": _max_error(sweep, "predicted_s"),
                         "max_calibration_prediction_error": _max_error(sweep, "calibration_predicted_s")})
            if progress_file is not None:
                progress_file.parent.mkdir(parents=True, exist_ok=True)
                with progress_file.open("a") as f:
                    f.write(json.dumps({"setup": setup, "row": rows[-1]}) + "\n")
    return {"config": {**asdict(cfg), "documents": documents}, "model": loaded.name, "dtype": config.dtype,
            "device": rows[0]["calibration"]["device"], "prompts": len(examples), "tiers": rows}


def format_table(report: dict) -> str:
    """Table 5: per tier the ratios, TTFTs, speedups and KL; then the model against the sweep."""
    lines = [f"Fixed against calibrated r, {report['model']} {report['dtype']} on {report['device']}, "
             f"{report['prompts']} prompts", "",
             "| tier | medium | calibrated r | full recompute s | fixed r s | calibrated r s | speedup fixed | "
             "speedup calibrated | calibrated vs fixed | KL fixed | KL calibrated | calibration s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["tiers"]:
        c, cal = row["compare"], row["calibration"]
        lines.append(
            f"| {row['tier']} | {row['spec']} | {cal['ratio']:.3f} | {c['full_recompute']['ttft_s']:.2f} | "
            f"{c['fixed']['ttft_s']:.2f} | {c['calibrated']['ttft_s']:.2f} | {c['fixed']['speedup']:.2f}x | "
            f"{c['calibrated']['speedup']:.2f}x | {c['fixed']['ttft_s'] / c['calibrated']['ttft_s']:.2f}x | "
            f"{c['fixed']['kl']:.4f} | {c['calibrated']['kl']:.4f} | {cal['seconds']:.0f} |")
    lines += ["", "Cost model against measurement: mean TTFT over the prompts (s), measured / pipelined prediction "
                  "from the profile measured alongside; then the largest error of that prediction and of the one "
                  "from the calibration's own profile:", "",
              "| tier | warm start | " + " | ".join(f"r={p['ratio']:g}" for p in report["tiers"][0]["sweep"])
              + " | max error | max error, calibration's profile |",
              "|---|---|" + "---|" * len(report["tiers"][0]["sweep"]) + "---|---|"]
    for row in report["tiers"]:
        cells = [f"{p['measured_s']:.2f} / {p['predicted_s']:.2f}" for p in row["sweep"]]
        lines.append(f"| {row['tier']} | {row['calibration']['warm_start']:.3f} | " + " | ".join(cells) +
                     f" | {row['max_prediction_error']:.0%} | {row.get('max_calibration_prediction_error', 0):.0%} |")
    notes = [f"- `{row['tier']}` is `{row['spec']}`: {row['note']}." for row in report["tiers"] if row["note"]]
    return "\n".join(lines + ([""] + notes if notes else []))


def plot_sweeps(report: dict, path: str | Path) -> Path:
    """Figure 10: TTFT against r per tier (measured, predicted), the calibrated r marked."""
    plt = pyplot()
    rows = report["tiers"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        rs = [p["ratio"] for p in row["sweep"]]
        ax.plot(rs, [p["measured_s"] for p in row["sweep"]], "o-", label="measured")
        ax.plot(rs, [p["predicted_s"] for p in row["sweep"]], "--", label="model, pipelined")
        ax.plot(rs, [p["sequential_s"] for p in row["sweep"]], ":", label="model, sequential")
        if "calibration_predicted_s" in row["sweep"][0]:
            ax.plot(rs, [p["calibration_predicted_s"] for p in row["sweep"]], "-.", alpha=0.6,
                    label="model, calibration's profile")
        cal = row["calibration"]
        ax.axvline(cal["ratio"], color="tab:red", alpha=0.6, label=f"calibrated r = {cal['ratio']:.2f}")
        ax.scatter([p["ratio"] for p in cal["probes"]], [p["ttft_s"] for p in cal["probes"]], s=12,
                   color="tab:red", zorder=3, label="search probes")
        ax.set(title=row["spec"], xlabel="recompute ratio r", ylabel="TTFT (s, mean of medians)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path, f"TTFT against r per tier, {report['model']}")
