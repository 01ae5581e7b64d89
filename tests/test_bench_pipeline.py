"""Throttled media and `cachetune bench-pipeline` (the numbers themselves are benchmarks, not tests)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cachetune.eval.bench_pipeline import VARIANTS, PipelineBenchConfig, moved_layout, run_bench_pipeline
from cachetune.eval.datasets import bundled_sample_path, load_dataset
from cachetune.runtime.prefill import selective_prefill
from cachetune.store.disk import DiskStore
from cachetune.store.memory import MemoryStore
from cachetune.store.throttled import Medium, ThrottledStore
from conftest import FINGERPRINT, tiny_engine
from test_loading import chunk_layout, llama, select
from test_store import FP, make_chunk


class Clock:
    """time.perf_counter and time.sleep for a test: time passes only while someone sleeps, so what a
    throttled read waits is measured exactly, whatever the machine's load."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        self.lock = threading.Lock()
        monkeypatch.setattr(time, "perf_counter", self.perf_counter)
        monkeypatch.setattr(time, "sleep", self.sleep)

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.now += max(seconds, 0.0)


@pytest.mark.parametrize("inner", ["memory", "disk"])
def test_a_throttled_tier_gives_the_same_rows_at_the_speed_of_its_medium(inner, tmp_path, monkeypatch) -> None:
    medium = Medium(bandwidth=20e6, latency_s=2e-3)
    store = ThrottledStore(MemoryStore() if inner == "memory" else DiskStore(tmp_path, FP), medium)
    chunk = make_chunk(n=200, seed=1)
    store.put(chunk)
    clock = Clock(monkeypatch)
    got = store.get(chunk.chunk_id)
    assert clock.now == pytest.approx(medium.latency_s)  # the lookup is one request to the medium
    idx = chunk.ranking[50:]
    start = clock.now
    k, v = got.load_layer(1, idx)
    assert torch.equal(k, chunk.keys[1][idx]) and torch.equal(v, chunk.values[1][idx])
    assert clock.now - start == pytest.approx(medium.seconds(k.nbytes + v.nbytes))
    start = clock.now
    whole = got.encoded()
    assert torch.equal(whole.keys, chunk.keys) and torch.equal(whole.values, chunk.values)
    assert clock.now - start == pytest.approx(medium.seconds(chunk.keys.nbytes + chunk.values.nbytes))


def test_a_prefill_from_a_throttled_tier_waits_for_its_reads_and_is_exact(tmp_path, monkeypatch) -> None:
    adapter = llama(3)
    layout = chunk_layout(adapter, MemoryStore(), 3, 40)
    medium = Medium(bandwidth=1e9, latency_s=5e-3)
    slow = ThrottledStore(DiskStore(tmp_path, FINGERPRINT), medium)
    moved = moved_layout(layout, slow)
    selections = select(layout, "ranked", 0.2)
    want = selective_prefill(adapter, layout, selections, layout.total)
    clock = Clock(monkeypatch)
    got = selective_prefill(adapter, moved, selections, layout.total)
    assert clock.now >= 3 * 3 * medium.latency_s  # 3 chunks x 3 layers, one request each
    assert torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("tier", ["cpu", "disk", "ssd", "matched"])
def test_bench_pipeline_reports_every_configuration(tier, tmp_path) -> None:
    engine = tiny_engine(self_check=False)
    examples = load_dataset(str(bundled_sample_path()), 1)
    cfg = PipelineBenchConfig(tier=tier, repeats=1, documents=3, disk_dir=str(tmp_path))
    report = run_bench_pipeline(engine, examples, cfg, progress=False)
    assert set(report["ttft_ms"]) == {*VARIANTS, "full_recompute", "load", "compute"}
    assert all(ms > 0 for ms in report["ttft_ms"].values())
    assert report["median_loaded_MB"] > 0
    if tier == "matched":
        assert report["matched_profile"]["bandwidth_MBps"] > 0


def test_bench_pipeline_rejects_an_unknown_tier() -> None:
    with pytest.raises(ValueError, match="tier"):
        PipelineBenchConfig(tier="tape")
