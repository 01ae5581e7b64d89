"""Hardware-aware recompute ratio: the cost model, the golden-section search, the
calibration file, throttled tiers, ratio="auto" in the engine, and calibration end to end on a tiny
model over a real (throttled) disk tier. Deep focus's measured price in the same file."""

from __future__ import annotations

import json
import logging
import math
import time

import pytest
import torch

from conftest import rand_ids, tiny_engine
from cachetune.config import EngineConfig, TierSpec, parse_medium, parse_tiers
from cachetune.engine.calibration import AUTO, PRICE, CalibrationFile, CalibrationKey
from cachetune.methods.cachetune import DEEP_DTYPE
from cachetune.methods.signals import PRICE_SCALE, deep_focus_price
from cachetune.runtime.prefill import reuse_plan
from cachetune.store.memory import MemoryStore
from cachetune.store.throttled import Medium, ThrottledStore
from cachetune.store.tiered import TieredStore
from cachetune.tuning.calibrate import CalibrationConfig, calibrate, measured_ttft, save_calibration
from cachetune.tuning.price import deep_focus_spec, measure_price, save_price
from cachetune.tuning.cost import PromptShape, Profile, model_optimum, nonnegative_fit, predict_ttft
from cachetune.tuning.profile import prompt_shape, top_selections
from cachetune.tuning.search import golden_section

KEY = CalibrationKey("fp", "cpu:test:2t", "float32", "disk:/data@hdd")


def _profile(**kw) -> Profile:
    base = dict(layers=4, t_o=0.0, t_c=1e-3, t_a=0.0, t_lo=0.0, t_seek=0.0, t_i=0.0, overlapped=True)
    return Profile(**{**base, **kw})


# ---- cost model -------------------------------------------------------------------------------
def test_prompt_shape_counts_what_the_selective_prefill_computes_and_reads(layout_builder, tiny_adapter):
    _, adapter = tiny_adapter("llama")
    layout, _ = layout_builder(adapter, [(rand_ids(5, 1), False), (rand_ids(33, 2), True), (rand_ids(18, 3), True),
                                         (rand_ids(7, 4), False)])
    shape = prompt_shape(layout)
    for ratio in (0.0, 0.1, 0.15, 0.37, 0.5, 1.0):
        active, parts, _ = reuse_plan(layout, top_selections(layout, ratio))
        assert shape.active(ratio) == active.numel()
        assert shape.reused(ratio) == sum(p[1].numel() for p in parts)


def test_pipelined_ttft_is_the_slower_path_per_layer_and_sequential_the_sum():
    shape = PromptShape(tokens=100, chunks=(100,))
    # r = 0.5: 50 active tokens, 50 rows read; C = 50 ms, B = 100 ms per layer.
    profile = _profile(t_c=1e-3, t_i=2e-3)
    assert predict_ttft(profile, shape, 0.5) == pytest.approx(0.1 + 3 * 0.1 + 0.05)
    assert predict_ttft(profile, shape, 0.5, pipelined=False) == pytest.approx(4 * 0.15)
    # Reads that share the forward's cores (a CPU arena) never overlap it.
    arena = _profile(t_c=1e-3, t_i=2e-3, overlapped=False)
    assert predict_ttft(arena, shape, 0.5) == pytest.approx(4 * 0.15)
    assert predict_ttft(profile, shape, 1.0) == pytest.approx(4 * 0.1)  # nothing read at r = 1


def test_model_optimum_is_the_floor_when_compute_dominates_and_the_crossing_when_loading_does():
    shapes = [PromptShape(1000, (500, 500))]
    assert model_optimum(_profile(t_c=1e-3, t_i=1e-5), shapes, 0.15, 1.0) == pytest.approx(0.15)
    # C = r N t_c, B = (1 - r) N t_i: equal at r = t_i / (t_c + t_i) = 0.4.
    assert model_optimum(_profile(t_c=3e-3, t_i=2e-3), shapes, 0.15, 1.0) == pytest.approx(0.4, abs=0.005)
    # Sequentially the cost is linear in r: an end of the interval.
    assert model_optimum(_profile(t_c=3e-3, t_i=2e-3), shapes, 0.15, 1.0, pipelined=False) == pytest.approx(0.15)
    assert model_optimum(_profile(t_c=1e-3, t_i=2e-3), shapes, 0.15, 1.0, pipelined=False) == pytest.approx(1.0)


def test_nonnegative_fit_recovers_costs_and_never_returns_a_negative_one():
    g = torch.Generator().manual_seed(0)
    feats = torch.rand(20, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 100.0, 1e4], dtype=torch.float64)
    truth = torch.tensor([0.5, 0.02, 3e-4], dtype=torch.float64)
    fit = nonnegative_fit(feats.tolist(), (feats @ truth).tolist())
    assert fit == pytest.approx(truth.tolist(), rel=1e-6)
    # y falls with the second feature: the unconstrained fit would give it a negative cost.
    fit = nonnegative_fit([[1, 0], [1, 1], [1, 2]], [3.0, 2.0, 1.0])
    assert all(c >= 0 for c in fit) and fit[1] == 0.0 and fit[0] == pytest.approx(2.0)


# ---- search -----------------------------------------------------------------------------------
@pytest.mark.parametrize("minimum", [0.22, 0.4, 0.63, 0.9])
@pytest.mark.parametrize("start", [0.15, 0.45, 0.95])
def test_golden_section_finds_the_minimum_of_a_unimodal_objective(minimum, start):
    calls = []

    def ttft(r):
        calls.append(r)
        return 1 + abs(r - minimum) * 3 + (r - minimum) ** 2

    result = golden_section(ttft, 0.15, 1.0, start, eps=0.02)
    assert abs(result.ratio - minimum) <= 0.02
    assert min(calls) >= 0.15 and max(calls) <= 1.0       # the floor is never crossed
    assert len(calls) == len(set(calls)) == len(result.probes)  # no probe is measured twice


def test_each_golden_iteration_costs_one_new_probe():
    result = golden_section(lambda r: (r - 0.5) ** 2, 0.15, 1.0, start=0.5, eps=0.01, width=0.3)
    iterations = math.ceil(math.log(0.01 / 0.3) / math.log((math.sqrt(5) - 1) / 2))
    assert len(result.probes) == 4 + iterations  # the bracket's ends and golden points, then one per iteration
    assert result.bracket[1] - result.bracket[0] <= 0.01


def test_a_monotone_objective_returns_exactly_the_limit():
    assert golden_section(lambda r: r, 0.15, 1.0, start=0.15).ratio == 0.15    # fast tier: the quality floor
    assert golden_section(lambda r: -r, 0.15, 1.0, start=0.3).ratio == 1.0


def test_noise_between_close_probes_does_not_walk_off_a_floor_that_was_clearly_best():
    def ttft(r):  # rising, but the probe near 0.177 measured high: it compares the wrong way with 0.194
        return 1.0 + r + (0.05 if 0.17 < r < 0.18 else 0.0)

    result = golden_section(ttft, 0.15, 1.0, start=0.15, eps=0.005)
    assert result.bracket[0] > 0.17  # the bracket did walk off the floor
    assert result.ratio == 0.15      # but the floor measured lowest of all


def test_search_arguments_are_checked():
    with pytest.raises(ValueError):
        golden_section(lambda r: r, 0.5, 0.4, 0.45)
    with pytest.raises(ValueError):
        golden_section(lambda r: r, 0.1, 1.0, 0.5, eps=0)


# ---- calibration file -------------------------------------------------------------------------
def test_calibration_file_round_trips_and_keeps_other_entries(tmp_path):
    path = tmp_path / "cal" / "calibration.json"
    cal = CalibrationFile(path)
    assert cal.ratio(KEY) is None  # no file yet
    cal.store(KEY, {"ratio": 0.31})
    other = CalibrationKey("fp", "cpu:test:2t", "float32", "cpu")
    cal.store(other, {"ratio": 0.15})
    assert cal.ratio(KEY) == 0.31 and cal.ratio(other) == 0.15
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []  # atomic: nothing left behind
    data = json.loads(path.read_text())
    assert data["format"] == "cachetune-calibration/1" and len(data["entries"]) == 2


@pytest.mark.parametrize("field", ["fingerprint", "device", "dtype", "tier"])
def test_a_calibration_is_not_used_once_model_device_dtype_or_tier_change(tmp_path, field):
    cal = CalibrationFile(tmp_path / "c.json")
    cal.store(KEY, {"ratio": 0.4})
    changed = CalibrationKey(**{**KEY.__dict__, field: "other"})
    assert cal.ratio(changed) is None


def test_a_calibration_written_by_another_process_is_seen_by_a_running_reader(tmp_path):
    reader, writer = CalibrationFile(tmp_path / "c.json"), CalibrationFile(tmp_path / "c.json")
    assert reader.ratio(KEY) is None
    writer.store(KEY, {"ratio": 0.5})
    assert reader.ratio(KEY) == 0.5
    time.sleep(0.01)
    writer.store(KEY, {"ratio": 0.6})
    assert reader.ratio(KEY) == 0.6


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"format": "other", "entries": {}}', "\xff\xfe"])
def test_an_unreadable_file_is_ignored_and_kept_aside_on_the_next_write(tmp_path, text, caplog):
    path = tmp_path / "c.json"
    path.write_bytes(text.encode("latin-1"))
    cal = CalibrationFile(path)
    with caplog.at_level(logging.WARNING):
        assert cal.ratio(KEY) is None
    assert "ignored" in caplog.text
    cal.store(KEY, {"ratio": 0.2})
    assert cal.ratio(KEY) == 0.2
    assert (tmp_path / "c.json.bad").read_bytes() == text.encode("latin-1")


@pytest.mark.parametrize("ratio", ["0.3", 1.5, -0.1, None, True, float("nan")])
def test_an_entry_without_a_valid_ratio_is_never_used_nor_written(tmp_path, ratio):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "cachetune-calibration/1", "entries": {KEY.text(): {"ratio": ratio}}}))
    assert CalibrationFile(path).ratio(KEY) is None
    with pytest.raises(ValueError):
        CalibrationFile(tmp_path / "d.json").store(KEY, {"ratio": ratio})


# ---- throttled tiers --------------------------------------------------------------------------
def test_tier_specs_take_a_medium_and_name_it_in_their_label(tmp_path):
    disk = parse_tiers(f"cpu:1GiB,disk:{tmp_path}:2GiB@60MB/s+5ms")[1]
    assert (disk.kind, disk.path, disk.max_bytes, disk.throttle) == ("disk", str(tmp_path), 2 * 2**30, "60MB/s+5ms")
    assert disk.label("/elsewhere") == f"disk:{tmp_path.resolve()}@60MB/s+5ms"
    assert parse_tiers("disk@hdd")[0].label(tmp_path) == f"disk:{tmp_path.resolve()}@hdd"
    assert parse_medium("hdd") == (150e6, 5e-3) and parse_medium("2.5GB/s") == (2.5e9, 0.0)
    redis = parse_tiers("redis://user:secret@host:6379/0")[0]  # an @ in a URL is its credentials
    assert redis.throttle is None and redis.label("/") == "redis://host:6379/0"
    assert TierSpec("cpu", 1).label("/") == "cpu"
    for bad in ("disk@fast", "disk@0MB/s", "disk@60MB"):
        with pytest.raises(ValueError, match="medium"):
            parse_tiers(bad)


def test_a_throttled_tier_reads_at_the_medium_pace_and_answers_as_the_plain_one(tmp_path):
    ids = [rand_ids(120, 21), rand_ids(90, 22)]
    plain = tiny_engine(tiers="cpu")
    slow = tiny_engine(tiers=f"disk:{tmp_path}@2MB/s+1ms")
    prompts = []
    for engine in (plain, slow):
        chunks = [engine.cache_tokens(t) for t in ids]
        prompts.append(engine.build_prompt(chunks, "w1 w2 w3"))
    assert {seg.chunk.tier for _, seg in prompts[1].chunk_segments} == {f"disk:{tmp_path.resolve()}@2MB/s+1ms"}
    start = time.perf_counter()
    got = slow.prefill(prompts[1], "cachetune", 0.0)
    elapsed = time.perf_counter() - start
    ref = plain.prefill(prompts[0], "cachetune", 0.0)
    torch.testing.assert_close(got.logits, ref.logits)
    layers, kv_heads, head_dim = slow.adapter.kv_shape
    row_bytes = 2 * kv_heads * head_dim * 4
    assert elapsed >= layers * (210 * row_bytes / 2e6 + 2 * 1e-3)  # every layer's rows at 2 MB/s, a ms a read


def test_a_throttled_tier_in_a_chain_still_demotes_what_it_evicts(tmp_path, tiny_adapter):
    from cachetune.chunks.encode import encode_chunk

    _, adapter = tiny_adapter("llama")
    chunks = [encode_chunk(adapter, rand_ids(40, s), "fp") for s in (1, 2, 3)]
    one = chunks[0].keys.numel() * 4 * 2
    front = ThrottledStore(MemoryStore(int(one * 1.5)), Medium(1e9))
    chain = TieredStore([front, MemoryStore()])  # not shared: only demotion puts chunks there
    for c in chunks:
        chain.put(c)
    assert all(chain.get(c.chunk_id) is not None for c in chunks)  # the evicted ones were demoted


# ---- ratio="auto" -----------------------------------------------------------------------------
def _prompt(engine, seeds=(31, 32)):
    return engine.build_prompt([engine.cache_tokens(rand_ids(80, s)) for s in seeds], "w5 w6")


def test_auto_is_the_floor_without_a_calibration_and_the_calibrated_ratio_with_one(tmp_path):
    engine = tiny_engine(tiers="cpu", calibration=str(tmp_path / "c.json"), min_ratio=0.2, length_floors="")
    prompt = _prompt(engine)
    assert engine.auto_ratio(prompt) == 0.2 and engine.calibrated_ratios() == {}
    engine.calibration.store(engine.calibration_key("cpu"), {"ratio": 0.45})
    assert engine.calibrated_ratios() == {"cpu": 0.45}
    auto = engine.generate([s.chunk.chunk_id for _, s in prompt.chunk_segments], "w5 w6", ratio=AUTO)
    fixed = engine.generate([s.chunk.chunk_id for _, s in prompt.chunk_segments], "w5 w6", ratio=0.45)
    assert auto.ratio == 0.45 and auto.token_ids == fixed.token_ids
    assert auto.recomputed_tokens == 2 * round(0.45 * 80) == fixed.recomputed_tokens
    # Another device's (or dtype's) calibration is not this engine's.
    other = CalibrationFile(tmp_path / "d.json")
    other.store(CalibrationKey(engine.fingerprint, "cuda:Some GPU", "float32", "cpu"), {"ratio": 0.9})
    engine2 = tiny_engine(tiers="cpu", calibration=str(tmp_path / "d.json"), length_floors="")
    assert engine2.auto_ratio(_prompt(engine2)) == EngineConfig.min_ratio


def test_auto_never_goes_below_the_floor_for_the_request_s_mean_chunk_length(tmp_path):
    """length_floors "50:0.4,100:0.25": chunks averaging 45 tokens run "auto" at 0.4 and those
    averaging 80 at 0.25, whatever the tier's calibration says below that; longer ones keep min_ratio
    or the calibrated ratio above it."""
    engine = tiny_engine(tiers="cpu", calibration=str(tmp_path / "c.json"), min_ratio=0.15,
                         length_floors="50:0.4,100:0.25")
    short = engine.build_prompt([engine.cache_tokens(rand_ids(n, 60 + n)) for n in (40, 50)], "w5")
    mid, long = _prompt(engine), engine.build_prompt([engine.cache_tokens(rand_ids(120, 63))], "w5")
    assert [engine.auto_ratio(p) for p in (short, mid, long)] == [0.4, 0.25, 0.15]
    engine.calibration.store(engine.calibration_key("cpu"), {"ratio": 0.3})
    assert [engine.auto_ratio(p) for p in (short, mid, long)] == [0.4, 0.3, 0.3]
    ids = [s.chunk.chunk_id for _, s in short.chunk_segments]
    auto, fixed = engine.generate(ids, "w5", ratio=AUTO), engine.generate(ids, "w5", ratio=0.4)
    assert auto.ratio == 0.4 and auto.token_ids == fixed.token_ids
    assert auto.recomputed_tokens == round(0.4 * 90) == fixed.recomputed_tokens


def test_a_request_without_a_ratio_gets_auto_only_where_a_tier_is_calibrated(tmp_path):
    engine = tiny_engine(tiers="cpu", calibration=str(tmp_path / "c.json"))
    assert engine.request_ratio(None) is None and engine.request_ratio(0.3) == 0.3
    engine.calibration.store(engine.calibration_key("cpu"), {"ratio": 0.45})
    assert engine.request_ratio(None) == AUTO and engine.request_ratio(0.3) == 0.3
    assert engine.request_ratio(None, auto_by_default=False) is None  # a server with auto_ratio off


def test_auto_takes_the_slowest_tier_a_request_reads_from(tmp_path):
    # The cpu tier holds 60 rows: a 40-token chunk stays there, a 100-token one only fits on disk.
    row = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32 of the tiny model
    engine = tiny_engine(tiers=f"cpu:{row * 60},disk:{tmp_path / 'kv'}", calibration=str(tmp_path / "c.json"),
                         length_floors="")
    cpu, disk = engine.tier_labels()
    engine.calibration.store(engine.calibration_key(cpu), {"ratio": 0.15})
    engine.calibration.store(engine.calibration_key(disk), {"ratio": 0.6})
    small, large = engine.cache_tokens(rand_ids(40, 51)), engine.cache_tokens(rand_ids(100, 52))
    both = engine.build_prompt([small, large], "w5")
    assert [seg.chunk.tier for _, seg in both.chunk_segments] == [cpu, disk]
    assert engine.auto_ratio(both) == 0.6
    assert engine.auto_ratio(engine.build_prompt([small], "w5")) == 0.15


def test_bad_ratios_are_refused_with_a_clear_error(tmp_path):
    engine = tiny_engine(tiers="cpu")
    with pytest.raises(ValueError, match="auto"):
        engine.method("cachetune", "fast")
    with pytest.raises(ValueError, match="prompt"):
        engine.method("cachetune", AUTO)
    with pytest.raises(ValueError, match="min_ratio"):
        EngineConfig(min_ratio=1.5)


# ---- calibration end to end -------------------------------------------------------------------
def test_calibration_on_a_slow_tier_recomputes_more_and_auto_then_uses_it(tmp_path):
    """A disk read at 1 MB/s: loading the tiny model's rows costs far more than computing them, so
    the search must leave the floor, beat it on measured TTFT, and be what "auto" serves."""
    engine = tiny_engine(tiers=f"disk:{tmp_path / 'kv'}@1MB/s", calibration=str(tmp_path / "c.json"),
                         length_floors="")
    prompts = [_prompt(engine, (41, 42)), _prompt(engine, (43, 44))]
    cfg = CalibrationConfig(repeats=1, eps=0.05)
    report = calibrate(engine, prompts, cfg, progress=False)
    assert report["ratio"] > 0.15 and report["profile"]["overlapped"]
    assert report["warm_start"] > 0.15  # the cost model saw loading dominate too
    fixed, calibrated = (measured_ttft(engine, prompts, r, cfg)[0] for r in (0.15, report["ratio"]))
    assert calibrated < fixed
    key = save_calibration(engine, report)
    assert key.tier == engine.tier_labels()[0] and engine.calibrated_ratios() == {key.tier: report["ratio"]}
    assert engine.auto_ratio(_prompt(engine, (41, 42))) == report["ratio"]


def test_calibration_refuses_prompts_without_chunks_or_from_several_tiers(tmp_path):
    engine = tiny_engine(tiers="cpu")
    with pytest.raises(ValueError, match="chunks"):
        calibrate(engine, [engine.build_prompt([], "w1 w2")], progress=False)


# ---- deep focus's price -----------------------------------------------------------------------
PRICE_KEY = CalibrationKey("fp", "cpu:test:2t", "float32", "", PRICE)


def test_a_price_scale_is_an_entry_of_its_own_beside_the_tier_ratios(tmp_path):
    cal = CalibrationFile(tmp_path / "c.json")
    cal.store(KEY, {"ratio": 0.3})
    cal.store(PRICE_KEY, {"scale": 1.7, "ratio": 0.15})  # a price entry's ratio is where it was measured
    assert cal.value(PRICE_KEY) == 1.7 and cal.ratio(KEY) == 0.3
    assert cal.value(CalibrationKey("fp", "cpu:test:2t", "float32", "")) is None  # the ratio of tier ""
    with pytest.raises(ValueError, match="unknown calibration kind"):
        CalibrationKey("fp", "cpu", "float32", "", "speed")


@pytest.mark.parametrize("scale", ["1.2", 0, -1.0, 1e6, None, True, float("inf")])
def test_a_price_entry_without_a_valid_scale_is_never_used_nor_written(tmp_path, scale):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "cachetune-calibration/1", "entries": {PRICE_KEY.text(): {"scale": scale}}}))
    assert CalibrationFile(path).value(PRICE_KEY) is None
    with pytest.raises(ValueError, match="scale"):
        CalibrationFile(tmp_path / "d.json").store(PRICE_KEY, {"scale": scale})


def _logits(engine, prompt, method):
    return engine.prefill(prompt, method, 0.3).logits


def test_deep_within_decides_by_the_engines_calibrated_price_scale(tmp_path):
    """The same request takes deep focus under a small measured scale and its own settings under a
    large one; with none, PRICE_SCALE stands in. Each choice computes exactly what that selection does."""
    engine = tiny_engine(tiers="cpu", calibration=str(tmp_path / "c.json"))
    prompt = engine.build_prompt([engine.cache_tokens(rand_ids(n, s)) for n, s in ((90, 61), (70, 62))],
                                 "w5 w6 w7 w8")
    price = deep_focus_price(engine.adapter, prompt, 0.3, DEEP_DTYPE)
    assert 0 < price < 0.45
    own = ("cachetune:first:allocation=focus:start_share=0.8:signal=question:signal_layers=1:signal_tokens=1"
           ":short_chunks=0")  # deep_within alone decides
    deep_logits = _logits(engine, prompt, deep_focus_spec(engine.adapter.num_layers))
    own_logits = _logits(engine, prompt, f"{own}:deep_within=0")
    assert not torch.equal(deep_logits, own_logits)  # the two choices differ on this prompt
    assert engine.price_scale() is None  # uncalibrated: PRICE_SCALE stands in
    for within, expected in ((1.01 * PRICE_SCALE * price, deep_logits), (0.99 * PRICE_SCALE * price, own_logits)):
        assert torch.equal(_logits(engine, prompt, f"{own}:deep_within={within}"), expected), within
    within = f"{own}:deep_within={2 * price}"  # deep at a measured scale of 1.9, not at 2.1
    for scale, expected in ((1.9, deep_logits), (2.1, own_logits)):
        engine.calibration.store(engine.calibration_key("", PRICE), {"scale": scale})
        assert engine.price_scale() == scale
        assert torch.equal(_logits(engine, prompt, within), expected), scale


def test_measure_price_times_first_and_deep_focus_and_its_saved_scale_is_the_engines(tmp_path):
    engine = tiny_engine(tiers="cpu", calibration=str(tmp_path / "c.json"))
    prompts = [_prompt(engine, (71, 72)), _prompt(engine, (73, 74))]
    report = measure_price(engine, prompts, 0.15, repeats=1, progress=False)
    assert [p["tokens"] for p in report["prompts"]] == [p.total for p in prompts]
    for p, layout in zip(report["prompts"], prompts):
        assert p["first_s"] > 0 and p["deep_s"] > 0
        assert p["measured"] == pytest.approx(p["deep_s"] / p["first_s"] - 1)
        assert p["predicted"] == deep_focus_price(engine.adapter, layout, 0.15, DEEP_DTYPE)
    assert 1e-3 <= report["scale"] <= 1e3
    key = save_price(engine, report)
    assert key.kind == PRICE and engine.price_scale() == report["scale"]
    assert engine.calibrated_ratios() == {}  # a price is not a tier's ratio
    with pytest.raises(ValueError, match="chunks"):
        measure_price(engine, [engine.build_prompt([], "w1 w2")], progress=False)
