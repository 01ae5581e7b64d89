"""The eval harness's bookkeeping: config checks, resume log, request settings, summaries (no model),
and where its answers come from (a tiny model)."""

from __future__ import annotations

import json

import pytest
import torch

from cachetune.config import parse_length_floors
from cachetune.eval.datasets import QAExample
from cachetune.eval.harness import EvalConfig, ProgressLog, Setting, Variant, _Request, run_example
from cachetune.eval.report import (best_within, by_chunk_length, chunk_length_of, format_by_length,
                                   format_quality_floors, format_tables, paired_comparison, pareto_frontier,
                                   plot_frontier, plot_quality_by_length, plot_tradeoff, quality_floors,
                                   ratio_curves, summarize_records, sweep_records)


def test_config_puts_full_recompute_first_once_and_rejects_unknown_methods():
    cfg = EvalConfig(methods=["cachetune", "full_recompute", "epic", "cachetune"])
    assert cfg.methods == ["full_recompute", "cachetune", "epic"]
    assert [v.label for v in cfg.variants()] == cfg.methods
    with pytest.raises(ValueError, match="unknown method"):
        EvalConfig(methods=["nope"])
    with pytest.raises(ValueError, match="ratio"):
        EvalConfig(ratio=1.5)


def test_run_example_needs_full_recompute_as_reference():
    with pytest.raises(ValueError, match="full recompute"):
        run_example(None, None, [Variant("cachetune", "cachetune", 0.15)], "d")


def test_answers_come_from_the_step_loop_exactly_as_greedy_decoding_of_each_prefill():
    from functools import partial

    from cachetune.eval.harness import prepare
    from cachetune.runtime.decode import generate_tokens
    from conftest import tiny_engine, words

    engine = tiny_engine()
    ex = QAExample("musique-1", [words(30, 1), words(20, 2)], words(5, 3), ["w1"])
    variants = [Variant("full_recompute", "full_recompute", 0.15), Variant("cachetune", "cachetune", 0.15)]
    req = prepare(engine, ex, variants, max_new_tokens=6)
    record = run_example(engine, req, variants, "d")
    for v in variants:
        result = engine.prefill(req.prompt(), v.method, v.ratio)
        expected = generate_tokens(partial(result.extend, engine.adapter), result.logits, req.sampling,
                                   engine.stop_ids(), req._first_line_done)
        assert record["methods"][v.label]["answer"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert not engine.has_unfinished() and engine.kv_usage().used_rows == 0


def _record(dataset, i, ttft_full, ttft_fast, score_fast=0.5):
    return {"id": f"x-{i}", "dataset": dataset, "task": "qa", "prompt_tokens": 100, "methods": {
        "full_recompute": {"ttft_ms": ttft_full, "kl": 0.0, "top1": [1.0, 1.0], "match": 1.0, "score": 1.0,
                           "recomputed_share": 1.0, "answer": "a"},
        "fast": {"ttft_ms": ttft_fast, "kl": 0.2, "top1": [1.0, 0.0], "match": 0.0, "score": score_fast,
                 "recomputed_share": 0.15, "answer": "b"},
    }}


def test_progress_log_resumes_skips_torn_lines_and_refuses_other_runs(tmp_path):
    path = tmp_path / "run.progress.jsonl"
    key = {"model": "m", "ratio": 0.15}
    log = ProgressLog(path, key)
    log.add(_record("d", 0, [10.0], [2.0]))
    with path.open("a") as f:
        f.write('{"key": {"model": "m", "ra')  # an interrupted write
    again = ProgressLog(path, key)
    assert again.done("d", "x-0")["methods"]["fast"]["ttft_ms"] == [2.0]
    assert again.done("d", "x-1") is None
    with pytest.raises(ValueError, match="another run"):
        ProgressLog(path, {"model": "m", "ratio": 0.3})


def test_summary_ratios_percentiles_and_quality_relative_to_full():
    records = [_record("d", 0, [100.0, 120.0], [10.0, 30.0]), _record("d", 1, [110.0], [20.0], 0.25)]
    (summary,) = summarize_records(records, ["full_recompute", "fast"]).values()
    rows = {r["method"]: r for r in summary["results"]}
    assert rows["full_recompute"]["speedup_vs_full"] == 1.0
    assert rows["fast"]["speedup_vs_full"] == pytest.approx(110.0 / 20.0)  # medians over all timed requests
    assert rows["fast"]["ttft_ms_p95"] == pytest.approx(29.0)
    assert rows["fast"]["quality"] == pytest.approx(0.375)
    assert rows["fast"]["quality_vs_full"] == pytest.approx(0.375)
    assert rows["fast"]["top1_agree"] == pytest.approx(0.5)  # pooled over answer positions
    assert (rows["fast"]["examples_better"], rows["fast"]["examples_worse"]) == (0, 2)
    lo, hi = rows["fast"]["quality_vs_full_ci"]
    assert 0.25 <= lo <= 0.375 <= hi <= 0.5  # bootstrap means of the two per-example ratios
    report = {"model": "m", "dtype": "float32", "threads": 2, "config": {"ratio": 0.15},
              "datasets": {"d": summary}}
    table = format_tables(report)
    assert "| fast | 0.375 |" in table and "### d: 2 examples" in table
    assert f"| 0.375 | {lo:.2f}-{hi:.2f} | 0 / 2 |" in table
    klo, khi = rows["fast"]["kl_to_full_ci"]
    assert klo <= rows["fast"]["kl_to_full"] <= khi
    json.dumps(report)  # JSON-ready


def test_a_variant_added_on_resume_is_timed_against_its_own_full_recompute():
    records = [_record("d", 0, [1000.0], [10.0]), _record("d", 1, [1000.0], [20.0])]
    for rec, reference in zip(records, ([60.0], [80.0])):
        rec["methods"]["fast"]["full_ttft_ms"] = reference  # the reference timed in the adding pass
    (summary,) = summarize_records(records, ["full_recompute", "fast"]).values()
    rows = {r["method"]: r for r in summary["results"]}
    assert rows["fast"]["speedup_vs_full"] == pytest.approx(70.0 / 15.0)
    assert rows["full_recompute"]["speedup_vs_full"] == 1.0


class _FakeEngine:
    def tokenize(self, text):
        return torch.arange(len(text.split()))


def _req(n_chunks=6):
    ex = QAExample("musique-3", [f"doc {i}" for i in range(n_chunks)], "q?", ["a"])
    return _Request(_FakeEngine(), ex, [f"c{i}" for i in range(n_chunks)], "sys", "Question: ", None)


def test_settings_reorder_deterministically_and_add_a_preamble():
    filler = QAExample("other", ["word " * 700, "more " * 700], "q", ["a"])
    a, b = _req(), _req()
    Setting("shuffled", shuffle=True).apply(a, filler)
    Setting("shuffled", shuffle=True).apply(b, filler)
    assert a.chunk_ids == b.chunk_ids and sorted(a.chunk_ids) == sorted(_req().chunk_ids)
    assert a.chunk_ids != _req().chunk_ids and a.preamble is None
    c = _req()
    Setting("pre", preamble_tokens=1024).apply(c, filler)
    assert c.chunk_ids == _req().chunk_ids and c.preamble.numel() == 1024


def _progress_record(i: int) -> dict:
    return {"id": f"x-{i}", "dataset": "d", "task": "qa", "methods": {"full_recompute": {"ttft_ms": [1.0]}}}


def test_progress_log_cuts_a_torn_last_line_before_appending(tmp_path):
    path = tmp_path / "run.progress.jsonl"
    key = {"model": "m"}
    ProgressLog(path, key).add(_progress_record(0))
    with path.open("a") as f:
        f.write('{"key": {"model": "m"}, "record": {"id": "x-1", "da')  # the crash: no newline
    ProgressLog(path, key).add(_progress_record(2))
    again = ProgressLog(path, key)
    assert again.done("d", "x-0") == _progress_record(0)
    assert again.done("d", "x-2") == _progress_record(2)
    assert again.done("d", "x-1") is None  # the torn record runs again


def test_progress_log_keeps_a_complete_last_record_without_newline(tmp_path):
    path = tmp_path / "run.progress.jsonl"
    key = {"model": "m"}
    path.write_text(json.dumps({"key": key, "record": _progress_record(0)}))  # complete, only the newline is lost
    ProgressLog(path, key).add(_progress_record(1))
    again = ProgressLog(path, key)
    assert again.done("d", "x-0") == _progress_record(0)
    assert again.done("d", "x-1") == _progress_record(1)


def test_progress_log_still_refuses_another_runs_file(tmp_path):
    path = tmp_path / "run.progress.jsonl"
    ProgressLog(path, {"model": "m"}).add(_progress_record(0))
    with path.open("a") as f:
        f.write('{"key": {"mo')
    before = path.read_bytes()
    with pytest.raises(ValueError, match="another run"):
        ProgressLog(path, {"model": "other"})
    assert path.read_bytes() == before  # another run's file is left as it was


def test_gap_closed_and_loaded_bytes_come_from_gold_nll_and_reused_rows():
    records = []
    for i, (none, full, fast) in enumerate([(6.0, 2.0, 3.0), (4.0, 2.0, 4.0)]):
        rec = _record("d", i, [10.0], [1.0])
        rec.update(no_context_nll=none, chunk_tokens=80, kv_bytes_per_row=1024)
        rec["methods"]["full_recompute"].update(nll=full, reused_rows=0)
        rec["methods"]["fast"].update(nll=fast, reused_rows=20)
        records.append(rec)
    (summary,) = summarize_records(records, ["full_recompute", "fast"]).values()
    rows = {r["method"]: r for r in summary["results"]}
    # Means: no context 5.0, full 2.0, fast 3.5 -> (5 - 3.5) / (5 - 2) = 0.5 of the gap closed.
    assert rows["fast"]["gap_closed"] == pytest.approx(0.5) and rows["full_recompute"]["gap_closed"] == 1.0
    assert rows["fast"]["loaded_kib_per_doc_token"] == pytest.approx(0.25)  # 20 of 80 rows of 1 KiB
    assert "gap_closed" in format_tables({"model": "m", "dtype": "float32", "threads": 2, "config": {"ratio": 0.15},
                                          "datasets": {"d": summary}})
    plain = summarize_records([_record("d", 0, [10.0], [1.0])], ["full_recompute", "fast"])
    assert "gap_closed" not in plain["d"]["results"][0]  # older records without gold NLL: no column


def test_pareto_frontier_keeps_the_points_nothing_beats_on_both_cost_and_loss():
    points = {"a": (1.0, 0.5), "b": (2.0, 0.3), "c": (2.5, 0.4), "d": (3.0, 0.1), "e": (0.5, 0.9)}
    assert pareto_frontier(points) == ["e", "a", "b", "d"]  # c: b is cheaper and better
    assert best_within(points, 2.6) == "b" and best_within(points, 0.1) is None


def test_frontier_plots_and_table_for_a_ratio_sweep(tmp_path):
    records = [_record("d", i, [1000.0], [10.0]) for i in range(2)]
    for r in records:  # two budgets of one method, a cheaper worse one and a dearer better one
        r["methods"]["fast@0.1"] = {**r["methods"]["fast"], "ttft_ms": [8.0], "kl": 0.3}
        r["methods"]["fast@0.3"] = {**r["methods"]["fast"], "ttft_ms": [30.0], "kl": 0.1}
    labels = ["full_recompute", "fast", "fast@0.1", "fast@0.3"]
    report = {"model": "m", "dtype": "float32", "threads": 2, "config": {"ratio": 0.15},
              "datasets": summarize_records(records, labels)}
    assert "KL Pareto frontier over the 2 examples every variant ran on, fastest first" in format_tables(report)
    (png,) = plot_frontier(report, tmp_path, mark="fast@0.3")
    assert png.name == "frontier_d.png" and png.stat().st_size > 0


def test_long_method_names_widen_the_tradeoff_plot_instead_of_squeezing_its_axes(tmp_path):
    import matplotlib.image

    def png_width(name, out):
        records = [_record("d", i, [1000.0], [10.0]) for i in range(2)]
        for r in records:
            r["methods"][name] = r["methods"].pop("fast")
        report = {"model": "m", "dtype": "float32", "threads": 2, "config": {"ratio": 0.15},
                  "datasets": summarize_records(records, ["full_recompute", name])}
        (quality_png, _) = plot_tradeoff(report, tmp_path / out)
        return matplotlib.image.imread(quality_png).shape[1]

    short, long = png_width("fast", "short"), png_width("cachetune:" + "x" * 90, "long")
    # About 0.65 em a character at 8 pt and 120 dpi: 86 more characters need about 745 more pixels.
    assert 700 < long - short < 790


def test_rows_cover_the_examples_that_have_their_method():
    records = [_record("d", i, [1000.0], [10.0]) for i in range(3)]
    records[0]["methods"]["fast@0.3"] = {**records[0]["methods"]["fast"], "kl": 0.1, "score": 1.0}
    for r in records:  # a budget every example ran, cheaper and worse than `fast`
        r["methods"]["fast@0.1"] = {**r["methods"]["fast"], "ttft_ms": [8.0], "kl": 0.9}
    rows = {r["method"]: r for r in summarize_records(records, ["full_recompute", "fast", "fast@0.3"])["d"]["results"]}
    assert rows["fast"]["n_examples"] == 3 and rows["fast@0.3"]["n_examples"] == 1
    assert rows["fast@0.3"]["kl_to_full"] == 0.1 and rows["fast@0.3"]["quality_vs_full"] == 1.0
    assert sweep_records(records, ["fast", "fast@0.3"]) == records[:1]
    report = {"model": "m", "dtype": "float32", "threads": 2, "config": {"ratio": 0.15},
              "datasets": summarize_records(records, ["full_recompute", "fast", "fast@0.1", "fast@0.3"])}
    table = format_tables(report)
    assert "| n_examples |" in table and "| 1 |" in table
    # Without a separate frontier, the frontier line compares only the rows on all 3 examples.
    (front,) = [line for line in table.splitlines() if line.startswith("KL Pareto frontier")]
    assert "over the 3 examples" in front and "fast@0.1" in front and "fast@0.3" not in front


def test_paired_comparison_pairs_examples_and_takes_per_example_timing_ratios():
    records = [_record("d", i, [1000.0], [10.0 * (i + 1)]) for i in range(3)]
    for i, r in enumerate(records):
        fast = r["methods"]["fast"]
        r["methods"]["base"] = {**fast, "ttft_ms": [5.0 * (i + 1)]}           # fast takes twice as long
        r["methods"]["other"] = {**fast, "kl": 0.2 + 0.1 * (i != 1), "score": 1.0, "ttft_ms": [20.0 * (i + 1)],
                                 "top1": [1.0, 1.0] if i != 1 else [1.0, 0.0]}
    records.append(_record("d", 3, [1000.0], [10.0]))                        # no "other": left out
    c = paired_comparison(records, "fast", "other", "base")
    assert c["n_examples"] == 3
    assert c["kl"] == pytest.approx(0.2) and c["other_kl"] == pytest.approx(0.8 / 3)
    assert c["kl_diff"] == pytest.approx(-0.2 / 3) and c["wins"] == 2 and c["other_wins"] == 0
    lo, hi = c["kl_diff_ci"]
    assert -0.1 - 1e-9 <= lo <= c["kl_diff"] <= hi <= 1e-9
    assert c["top1"] == pytest.approx(0.5) and c["other_top1"] == pytest.approx(2.5 / 3)  # per-example means
    lo, hi = c["top1_diff_ci"]
    assert c["top1_diff"] == pytest.approx(-1 / 3) and -0.5 - 1e-9 <= lo <= c["top1_diff"] <= hi <= 1e-9
    assert c["ttft_vs_base"] == pytest.approx(2.0) and c["ttft_vs_base_ci"] == pytest.approx([2.0, 2.0])
    assert c["other_ttft_vs_base"] == pytest.approx(4.0)
    assert c["quality_vs_full"]["ratio"] == 0.5 and c["other_quality_vs_full"]["ratio"] == 1.0
    assert paired_comparison(records, "fast", "missing", "base") is None


def test_paired_comparison_times_a_variant_added_on_resume_against_its_own_pass():
    records = [_record("d", i, [100.0], [40.0]) for i in range(2)]
    for r in records:
        r["methods"]["base"] = {**r["methods"]["fast"], "ttft_ms": [20.0]}
        # added in a slower pass: twice its reference there, as fast is twice base in the first pass
        r["methods"]["added"] = {**r["methods"]["fast"], "ttft_ms": [100.0], "full_ttft_ms": [250.0]}
    c = paired_comparison(records, "added", "fast", "base")
    assert c["ttft_vs_base"] == pytest.approx(2.0) and c["other_ttft_vs_base"] == pytest.approx(2.0)


def test_sweep_examples_keep_only_the_main_ratio_past_the_first_examples():
    cfg = EvalConfig(methods=["full_reuse", "cachetune"], ratio=0.15, ratios=(0.1, 0.15), sweep_examples=2)
    variants = cfg.variants()
    assert cfg.variants_for(1, variants) == variants
    assert [v.label for v in cfg.variants_for(2, variants)] == ["full_recompute", "full_reuse", "cachetune@0.15"]
    with pytest.raises(ValueError, match="among the ratios"):
        EvalConfig(methods=["cachetune"], ratio=0.2, ratios=(0.1, 0.15), sweep_examples=2)
    with pytest.raises(ValueError, match="sweep_examples"):
        EvalConfig(methods=["cachetune"], ratios=(0.15,), sweep_examples=-1)


def test_run_key_names_the_selection_where_a_method_reads_it_and_deep_focus_whenever_it_is_on():
    from conftest import tiny_engine

    engine = tiny_engine(allocation="proportional", signal="none", self_check=False)  # not the defaults
    plain = EvalConfig(methods=["cachetune", "epic"]).run_key(engine)
    assert (plain["allocation"], plain["signal"]) == ("proportional", "none")
    named = EvalConfig(methods=["cachetune:first:allocation=spread:signal=question", "epic"]).run_key(engine)
    assert "allocation" not in named and "signal" not in named
    # under the defaults a run's key is what it was before the selection settings existed
    other = tiny_engine(self_check=False)
    assert "allocation" not in EvalConfig(methods=["cachetune"]).run_key(other)
    # explicit names measure the same whatever the defaults: a run resumes under other defaults
    assert EvalConfig(methods=["cachetune:first:allocation=spread:signal=question"]).run_key(other) == \
        EvalConfig(methods=["cachetune:first:allocation=spread:signal=question"]).run_key(engine)
    # deep focus by default is named whatever the methods (files before it ran without), unless off
    assert other.config.deep_within > 0
    assert EvalConfig(methods=["epic"]).run_key(other)["deep_within"] == other.config.deep_within
    off = tiny_engine(deep_within=0, self_check=False)
    assert "deep_within" not in EvalConfig(methods=["cachetune", "epic"]).run_key(off)



def test_a_method_at_its_own_ratio_runs_beside_the_runs_ratio():
    cfg = EvalConfig(methods=["cachetune", "cachetune@0.25", "epic"], ratio=0.15)
    assert [(v.label, v.method, v.ratio) for v in cfg.variants()] == [
        ("full_recompute", "full_recompute", 0.15), ("cachetune", "cachetune", 0.15),
        ("cachetune@0.25", "cachetune", 0.25), ("epic", "epic", 0.15)]
    for bad, message in (("cachetune@x", "method@ratio"), ("cachetune@1.5", "in \\[0, 1\\]"),
                         ("full_reuse@0.2", "recompute budget"), ("nope@0.2", "unknown method")):
        with pytest.raises(ValueError, match=message):
            EvalConfig(methods=[bad])


def test_quality_by_chunk_length_pairs_each_re_chunked_set_with_its_length(tmp_path):
    records = []
    for length, score in ((512, 1.0), (128, 0.5)):
        records += [_record(f"hotpotqa@{length}t", i, [1000.0], [100.0], score_fast=score) for i in range(3)]
    records += [_record("musique", i, [1000.0], [100.0]) for i in range(2)]  # not re-chunked: left out
    report = {"model": "m", "dtype": "float32", "threads": 2, "config": {"ratio": 0.15},
              "datasets": summarize_records(records, ["full_recompute", "fast"])}
    rows = by_chunk_length(report)
    assert list(rows) == ["hotpotqa"]
    fast = [(r["chunk_tokens"], r["quality_vs_full"]) for r in rows["hotpotqa"] if r["method"] == "fast"]
    assert fast == [(128, 0.5), (512, 1.0)]
    assert "| 128 | fast | 3 | 0.500 | 0.500 |" in format_by_length(rows)
    png = plot_quality_by_length(report, tmp_path)
    assert png.name == "quality_by_chunk_length.png" and png.stat().st_size > 0
    assert chunk_length_of("a@b@64t") == ("a@b", 64) and chunk_length_of("musique") is None
    assert plot_quality_by_length({**report, "datasets": {"musique": report["datasets"]["musique"]}}, tmp_path) is None


def test_ratio_curves_join_a_bare_label_at_the_runs_ratio():
    """A method listed bare and at other ratios ("x", "x@0.25") is one curve with the bare row at the
    run's ratio; a method run at one budget only is a line; full recompute is neither."""
    rows = [{"method": m, "kl_to_full": kl} for m, kl in [
        ("full_recompute", 0.0), ("x", 0.3), ("x@0.35", 0.1), ("x@0.25", 0.2), ("epic", 0.4), ("y@0.5", 0.05)]]
    curves, lines = ratio_curves(rows, 0.15)
    assert curves == {"x": [(0.15, 0.3), (0.25, 0.2), (0.35, 0.1)], "y": [(0.5, 0.05)]}
    assert lines == {"epic": 0.4}
    assert ratio_curves(rows)[1] == {"x": 0.3, "epic": 0.4}  # no known ratio: the bare row stays a line


def test_quality_floors_are_the_least_ratio_that_kept_the_target_on_every_set():
    """Per chunk length, the least of the run's ratio and the `cachetune@r` variants whose quality kept
    95% of full recompute's on every set; a length where none did is named as such, and the floors
    read back as an EngineConfig.length_floors value."""
    scores = {  # (set, length) -> cachetune's F1 at r = 0.15, 0.25, 0.35 (full recompute's: 1.0)
        ("a", 128): (0.5, 0.9, 0.97), ("b", 128): (0.6, 0.96, 0.99),
        ("a", 256): (0.1, 0.2, 0.3), ("b", 256): (0.5, 0.5, 0.5),
        ("a", 512): (0.96, 1.0, 1.0), ("b", 512): (0.96, 0.9, 1.0)}
    labels = ["full_recompute", "cachetune", "cachetune@0.25", "cachetune@0.35"]
    records = []
    for (name, length), values in scores.items():
        for i in range(3):
            record = _record(f"{name}@{length}t", i, [1000.0], [100.0])
            fast = record["methods"].pop("fast")
            record["methods"].update({label: {**fast, "score": v} for label, v in zip(labels[1:], values)})
            records.append(record)
    report = {"config": {"ratio": 0.15}, "datasets": summarize_records(records, labels)}
    floors = quality_floors(report)
    assert floors == {128: 0.35, 256: None, 512: 0.15}
    line = format_quality_floors(floors)
    assert "`--length-floors '128:0.35,512:0.15'`" in line and "at 256 tokens" in line
    assert parse_length_floors("128:0.35,512:0.15") == ((128, 0.35), (512, 0.15))
