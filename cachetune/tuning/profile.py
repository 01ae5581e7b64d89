"""The profiler: the cost model's constants for one model, device, dtype and tier, from real work.

For a few ratios and every calibration prompt it times, apart (medians over repeats, after a
warm-up), the two paths the pipeline overlaps:

- compute: the forward with every reused row already in memory (what the layers cost at that
  number of active tokens, reused keys rotated included);
- load: every layer's reuse complement read through the tier's own readers (positioned file reads,
  Redis round trips, a throttled medium's pace, an arena's gather) into the staging buffer.

Then fits C and B of `cost.Profile` by non-negative least squares over all the samples.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from cachetune.chunks.ranking import top_share
from cachetune.engine.engine import Engine
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import reuse_plan
from cachetune.runtime.forward import forward_active
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import LayerLoader, Pipeline
from cachetune.tuning.cost import Profile, PromptShape, nonnegative_fit


def prompt_shape(layout: PromptLayout) -> PromptShape:
    return PromptShape(layout.total, tuple(seg.chunk.num_tokens for _, seg in layout.chunk_segments))


def top_selections(layout: PromptLayout, ratio: float) -> list[torch.Tensor]:
    """cachetune's selection: the top `ratio` of every chunk by its stored ranking."""
    return [top_share(seg.chunk.ranking, ratio) for _, seg in layout.chunk_segments]


class Preloaded:
    """forward.ReusedKV with every layer already in memory (compute timed without any loading)."""

    def __init__(self, rows: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.rows, self._layers = rows, layers

    def begin(self, rotate) -> bool:
        return False  # the forward rotates the reused keys, as it does when loading is not deferred

    def layer(self, index: int):
        return self._layers[index]


def _timed(fn: Callable[[], None], before: Callable[[], object] | None = None) -> float:
    """Seconds `fn` takes (after `before`, e.g. dropping a disk tier's page cache, untimed)."""
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def load_and_compute(engine: Engine, layout: PromptLayout, selections: list[torch.Tensor],
                     before: Callable[[], object] | None = None) -> tuple[float, float, int]:
    """(seconds to read every layer's reused rows, seconds of the forward with them in memory,
    bytes read) of one selective prefill."""
    adapter = engine.adapter
    active, parts, _ = reuse_plan(layout, selections)
    plain = Pipeline(overlap=False, sparse=True, deferred_rope=False)
    layers: list = []

    def load() -> None:
        with LayerLoader(parts, adapter.kv_shape, adapter.device, adapter.dtype, plain) as loader:
            loader.begin(None)
            layers[:] = [tuple(t.clone() for t in loader.layer(i)) for i in range(adapter.num_layers)]
            layers.append(loader.rows)
        synchronize(adapter.device)

    load_s = _timed(load, before)
    rows = layers.pop()
    reused = Preloaded(rows, layers)

    def compute() -> None:
        cache = KVCache.empty(adapter.num_layers, layout.total, adapter.num_kv_heads, adapter.head_dim,
                              adapter.dtype, adapter.device)
        ids = layout.input_ids[active].to(adapter.device)
        hidden = forward_active(adapter, adapter.embed(ids), active.to(adapter.device), cache, reused=reused,
                                last_only=True)
        adapter.logits(hidden[-1:])
        synchronize(adapter.device)

    compute_s = _timed(compute)
    row_bytes = 2 * adapter.num_kv_heads * adapter.head_dim * adapter.dtype.itemsize
    return load_s, compute_s, int(rows.numel()) * row_bytes * adapter.num_layers


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer sees it done (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reads_overlap(engine: Engine, layout: PromptLayout) -> bool:
    """Whether the pipeline reads this prompt's chunks beside the forward: always on CUDA (a side
    stream); on CPU only for tiers whose reads wait on storage (disk, Redis, a throttled medium),
    since an arena's gather runs on the forward's own cores."""
    if engine.adapter.device.type == "cuda":
        return True
    return any(getattr(seg.chunk.reader, "blocking", False) for _, seg in layout.chunk_segments)


def profile_sample(layout: PromptLayout, ratio: float, runs: list[tuple[float, float, int]]) -> dict:
    """One profile sample: a prompt at a ratio, the medians of its timed load_and_compute runs."""
    shape = prompt_shape(layout)
    return {"tokens": shape.tokens, "chunks": len(shape.chunks), "ratio": ratio, "active": shape.active(ratio),
            "rows": shape.reused(ratio), "load_s": statistics.median(r[0] for r in runs),
            "compute_s": statistics.median(r[1] for r in runs), "bytes": runs[0][2]}


def fit_profile(samples: list[dict], layers: int, overlapped: bool) -> Profile:
    """The cost model's constants from samples (non-negative least squares, compute and loading apart)."""
    t_o, t_c, t_a = nonnegative_fit([[layers, layers * s["active"], layers * s["active"] * s["tokens"]]
                                     for s in samples], [s["compute_s"] for s in samples])
    loaded = [s for s in samples if s["rows"]]
    t_lo, t_seek, t_i = nonnegative_fit([[layers, layers * s["chunks"], layers * s["rows"]] for s in loaded],
                                        [s["load_s"] for s in loaded]) if loaded else (0.0, 0.0, 0.0)
    return Profile(layers, t_o, t_c, t_a, t_lo, t_seek, t_i, overlapped)


def pipelined(engine: Engine, layouts: list[PromptLayout]) -> bool:
    """Whether the engine overlaps these prompts' reads with compute (prefetch on, reads beside it)."""
    return engine.config.prefetch and all(reads_overlap(engine, layout) for layout in layouts)


def profile_tier(engine: Engine, layouts: list[PromptLayout], ratios: tuple[float, ...], repeats: int = 2,
                 before: Callable[[], object] | None = None, progress: bool = True) -> tuple[Profile, list[dict]]:
    """The fitted Profile and the raw samples (per prompt and ratio: median load and compute
    seconds, bytes read) for prompts whose chunks are all read from the tier being profiled."""
    samples = []
    bar = tqdm(total=len(layouts) * len(ratios) * (repeats + 1), desc="profile", disable=not progress)
    for layout in layouts:
        for ratio in ratios:
            chosen = top_selections(layout, ratio)
            runs = []
            for _ in range(repeats + 1):  # the first run warms up and is not counted
                runs.append(load_and_compute(engine, layout, chosen, before))
                bar.update(1)
            samples.append(profile_sample(layout, ratio, runs[1:]))
    bar.close()
    return fit_profile(samples, engine.adapter.num_layers, pipelined(engine, layouts)), samples
