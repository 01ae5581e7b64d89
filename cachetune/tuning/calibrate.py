"""Hardware-aware calibration of the recompute ratio (paper 4.3, C.1, C.2, D.4).

    report = calibrate(engine, layouts, CalibrationConfig())   # profile, model, search
    key = save_calibration(engine, report)                     # what ratio="auto" then uses

The engine's store must be the one tier being calibrated (a chain would promote chunks into its
fastest tier and time that instead). Steps: time compute and loading apart at a few ratios and fit
the cost model (profile.py); take its optimum in [min_ratio, max_ratio] as the warm start; run the
golden-section search on measured TTFT: per probe, every calibration prompt is prefilled by the
method at that ratio `repeats` times (the engine's real request path, pipeline included) and the
objective is the mean over prompts of each one's median TTFT. No reference answers are used; the
quality floor is min_ratio (the search never goes below it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tqdm import tqdm

from cachetune.config import QUALITY_FLOOR
from cachetune.engine.calibration import CalibrationKey
from cachetune.engine.engine import Engine
from cachetune.runtime.layout import PromptLayout
from cachetune.store.disk import DiskStore
from cachetune.tuning.cost import mean_ttft, model_optimum
from cachetune.tuning.profile import prompt_shape, profile_tier, synchronize
from cachetune.tuning.search import golden_section


@dataclass(frozen=True)
class CalibrationConfig:
    min_ratio: float = QUALITY_FLOOR  # r_min: the quality floor
    max_ratio: float = 1.0
    eps: float = 0.025                # the search stops when its bracket is narrower
    width: float = 0.3                # the bracket around the warm start
    repeats: int = 2                  # timed prefills per prompt and probe (after one warm-up pass)
    method: str = "cachetune"         # the method whose TTFT is minimised

    def __post_init__(self) -> None:
        if not 0 <= self.min_ratio < self.max_ratio <= 1:
            raise ValueError(f"need 0 <= min_ratio < max_ratio <= 1, got {self.min_ratio}, {self.max_ratio}")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")

    @property
    def profile_ratios(self) -> tuple[float, ...]:
        """Where compute and loading are timed: full reuse, the floor and the middle of the range
        (the model is linear in the active tokens and rows, so these span it; r = 1, the slowest
        point, adds little)."""
        return tuple(sorted({0.0, self.min_ratio, (self.min_ratio + self.max_ratio) / 2}))


def cold_reads(engine: Engine) -> Callable[[], object] | None:
    """What runs before every timed read: a disk tier's page cache dropped, so it reads the device."""
    return engine.store.drop_page_cache if isinstance(engine.store, DiskStore) else None


def prefill_seconds(engine: Engine, layout: PromptLayout, method: str, ratio: float,
                    before: Callable[[], object] | None = None) -> float:
    """One prefill up to the first token's logits, through the engine's request path."""
    if before is not None:
        before()
    start = time.perf_counter()
    engine.prefill(layout, method, ratio)
    synchronize(engine.adapter.device)
    return time.perf_counter() - start


def measured_ttft(engine: Engine, layouts: list[PromptLayout], ratio: float, cfg: CalibrationConfig,
                  before: Callable[[], object] | None = None) -> tuple[float, list[float]]:
    """(mean over prompts of each one's median TTFT, the per-prompt medians), seconds. Prompts are
    interleaved within each repeat, so drift of the machine hits all alike."""
    runs: list[list[float]] = [[] for _ in layouts]
    for _ in range(cfg.repeats):
        for i, layout in enumerate(layouts):
            runs[i].append(prefill_seconds(engine, layout, cfg.method, ratio, before))
    medians = [statistics.median(r) for r in runs]
    return sum(medians) / len(medians), medians


def calibrate(engine: Engine, layouts: list[PromptLayout], cfg: CalibrationConfig = CalibrationConfig(),
              progress: bool = True) -> dict:
    """Profile, model and search on `layouts` (chunks in the engine's store); a JSON-ready report."""
    if not layouts or not any(layout.chunk_segments for layout in layouts):
        raise ValueError("calibration needs prompts with cached chunks")
    tiers = {seg.chunk.tier for layout in layouts for _, seg in layout.chunk_segments}
    if len(tiers) != 1:
        raise ValueError(f"calibration prompts must read every chunk from one tier, got {sorted(tiers)}")
    before = cold_reads(engine)
    started = time.perf_counter()
    for layout in layouts:  # warm-up: first-call costs are nobody's TTFT
        prefill_seconds(engine, layout, cfg.method, cfg.min_ratio, before)
    profile, samples = profile_tier(engine, layouts, cfg.profile_ratios, cfg.repeats, before, progress)
    shapes = [prompt_shape(layout) for layout in layouts]
    start = model_optimum(profile, shapes, cfg.min_ratio, cfg.max_ratio)
    bar = tqdm(desc="search", unit="probe", disable=not progress)
    per_prompt: dict[float, list[float]] = {}

    def objective(ratio: float) -> float:
        mean, medians = measured_ttft(engine, layouts, ratio, cfg, before)
        per_prompt[ratio] = medians
        bar.update(1)
        bar.set_postfix(r=f"{ratio:.3f}", ttft=f"{mean * 1000:.0f}ms")
        return mean

    search = golden_section(objective, cfg.min_ratio, cfg.max_ratio, start, cfg.eps, cfg.width)
    bar.close()
    return {
        "ratio": search.ratio,
        "tier": tiers.pop(),
        "config": asdict(cfg),
        "model": engine.name,
        "dtype": engine.config.dtype,
        "device": engine.calibration_key("").device,
        "prompts": len(layouts),
        "prompt_tokens": [s.tokens for s in shapes],
        "profile": profile.to_dict(),
        "profile_samples": samples,
        "warm_start": start,
        "predicted_ttft_s": {"warm_start": mean_ttft(profile, shapes, start),
                             "chosen": mean_ttft(profile, shapes, search.ratio)},
        "probes": [{"ratio": r, "ttft_s": t, "per_prompt_s": per_prompt[r],
                    "predicted_s": mean_ttft(profile, shapes, r)} for r, t in search.probes],
        "bracket": list(search.bracket),
        "seconds": time.perf_counter() - started,
    }


def save_calibration(engine: Engine, report: dict) -> CalibrationKey:
    """Store the report's ratio in the engine's calibration file under its model, device, dtype and
    the tier the report was measured on; returns the key."""
    key = engine.calibration_key(report["tier"])
    entry = {k: report[k] for k in ("ratio", "model", "prompts", "prompt_tokens", "warm_start", "profile", "seconds")}
    entry.update(min_ratio=report["config"]["min_ratio"], method=report["config"]["method"],
                 created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    engine.calibration.store(key, entry)
    return key
