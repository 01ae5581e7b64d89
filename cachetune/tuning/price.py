"""Deep focus's price on this machine: how much its TTFT exceeds `first`'s, measured against the
multiply-add prediction (methods.signals.deep_focus_price) that the `deep_within` setting decides by.

    report = measure_price(engine, layouts)   # time first and deep focus on each prompt
    key = save_price(engine, report)          # what deep_within then multiplies its predictions by

The prediction counts multiply-adds; what they cost differs between machines (a CPU with AMX runs
`first`'s float32 prefill faster, so the same pass weighs more beside it). Per prompt, `first` and
deep focus are prefilled through the engine's request path `repeats` times each, alternating which
goes first, after one untimed warm-up of each; the measured price is the ratio of the medians less
one. The scale is the summed measured prices over the summed predicted ones (prompts weigh by their
price), clamped to the calibration file's range for a scale.
"""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from cachetune.config import EngineConfig
from cachetune.engine.calibration import KINDS, PRICE, CalibrationKey
from cachetune.engine.engine import Engine
from cachetune.runtime.layout import PromptLayout
from cachetune.methods.cachetune import DEEP_DTYPE, DEEP_START_SHARE
from cachetune.methods.signals import deep_focus_price
from cachetune.tuning.calibrate import prefill_seconds

FIRST = "cachetune:first:allocation=proportional:signal=none"  # what the price is counted over
REPEATS = 3


def deep_focus_spec(num_layers: int) -> str:
    """Deep focus as a method spec: what `deep_within` runs on a request it sends deep."""
    return (f"cachetune:first:allocation=focus:start_share={DEEP_START_SHARE:g}:signal=question:"
            f"signal_layers={num_layers}:signal_tokens=none:signal_dtype={DEEP_DTYPE}")


def measure_price(engine: Engine, layouts: list[PromptLayout], ratio: float = EngineConfig.ratio,
                  repeats: int = REPEATS, progress: bool = True) -> dict:
    """Time `first` and deep focus on `layouts` (chunks in the engine's store) at `ratio`; a JSON-ready
    report whose "scale" is measured over predicted price."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if not any(layout.chunk_segments for layout in layouts):
        raise ValueError("pricing deep focus needs prompts with cached chunks")
    deep = deep_focus_spec(engine.adapter.num_layers)
    started = time.perf_counter()
    times: list[dict[str, list[float]]] = [{FIRST: [], deep: []} for _ in layouts]
    bar = tqdm(total=len(layouts) * 2 * (repeats + 1), desc="price", unit="prefill", disable=not progress)
    for repeat in range(repeats + 1):  # repeat 0 warms up: first-call costs are nobody's TTFT
        order = (FIRST, deep) if repeat % 2 else (deep, FIRST)
        for i, layout in enumerate(layouts):
            for method in order:
                seconds = prefill_seconds(engine, layout, method, ratio)
                if repeat:
                    times[i][method].append(seconds)
                bar.update(1)
    bar.close()
    prompts = []
    for layout, t in zip(layouts, times):
        first_s, deep_s = statistics.median(t[FIRST]), statistics.median(t[deep])
        prompts.append({"tokens": layout.total, "first_s": first_s, "deep_s": deep_s,
                        "measured": deep_s / first_s - 1,
                        "predicted": deep_focus_price(engine.adapter, layout, ratio, DEEP_DTYPE)})
    _, low, high = KINDS[PRICE]
    scale = sum(p["measured"] for p in prompts) / sum(p["predicted"] for p in prompts)
    return {"scale": min(max(scale, low), high), "unclamped_scale": scale, "ratio": ratio, "repeats": repeats,
            "methods": {"first": FIRST, "deep": deep}, "model": engine.name, "dtype": engine.config.dtype,
            "device": engine.calibration_key("", PRICE).device, "prompts": prompts,
            "seconds": time.perf_counter() - started}


def save_price(engine: Engine, report: dict) -> CalibrationKey:
    """Store the report's scale in the engine's calibration file under its model, device and dtype."""
    key = engine.calibration_key("", PRICE)
    entry = {k: report[k] for k in ("scale", "ratio", "repeats", "model", "seconds")}
    entry.update(prompts=[{k: p[k] for k in ("tokens", "measured", "predicted")} for p in report["prompts"]],
                 created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    engine.calibration.store(key, entry)
    return key


def format_price(report: dict) -> str:
    """A readable table of the report: per prompt, both TTFTs and the measured and predicted price."""
    lines = [f"deep focus over first on {report['device']} ({report['model']}, {report['dtype']}, "
             f"r = {report['ratio']:g}, median of {report['repeats']}):",
             "| prompt tokens | first (ms) | deep focus (ms) | measured price | predicted price |",
             "|---:|---:|---:|---:|---:|"]
    for p in report["prompts"]:
        lines.append(f"| {p['tokens']} | {p['first_s'] * 1000:.0f} | {p['deep_s'] * 1000:.0f} | "
                     f"{p['measured']:+.3f} | {p['predicted']:.3f} |")
    lines.append(f"scale (measured over predicted): {report['scale']:.3f}"
                 + ("" if report["scale"] == report["unclamped_scale"] else f" (clamped from "
                                                                             f"{report['unclamped_scale']:.3f})"))
    return "\n".join(lines)
