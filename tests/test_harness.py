"""The eval harness's bookkeeping: config checks, resume log, request settings, summaries (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from cachetune.eval.datasets import QAExample
from cachetune.eval.harness import EvalConfig, ProgressLog, Setting, Variant, _Request, run_example
from cachetune.eval.report import (best_within, format_tables, paired_comparison, pareto_frontier, plot_frontier,
                                   plot_tradeoff, summarize_records, sweep_records)


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


def _script(name: str):
    """scripts/<name>.py loaded as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bars_script_reads_an_example_once_with_its_last_record_and_skips_a_torn_line(tmp_path):
    """A resumed run appends an example again with the variants it added: scripts/bars.py must count
    it once, with the later record, in the example's first position; --limit takes the first N."""
    bars = _script("bars")
    rows = [{"dataset": "d", "id": "a", "methods": {"x": 1}}, {"dataset": "d", "id": "b", "methods": {}},
            {"dataset": "d", "id": "a", "methods": {"x": 1, "y": 2}}]
    path = tmp_path / "p.progress.jsonl"
    path.write_text("".join(json.dumps({"key": {}, "record": r}) + "\n" for r in rows) + '{"key": {}, "rec')
    records = bars.load_records(path)
    assert [(r["id"], sorted(r["methods"])) for r in records] == [("a", ["x", "y"]), ("b", [])]
    assert [r["id"] for r in bars.load_records(path, limit=1)] == ["a"]
    timed = [{"methods": {"m": {"device": "cpu:B:2t"}}}, {"methods": {"m": {}}}, {"methods": {"n": {}}},
             {"methods": {"m": {"device": "cpu:A:2t"}}}, {"methods": {"m": {"device": "cpu:A:2t"}}}]
    assert bars.machines(timed, "m") == "cpu:A:2t (2), cpu:B:2t (1), unrecorded (1)"


def test_bars_script_compares_the_chosen_subject_with_every_other_method_it_finds(tmp_path):
    bars = _script("bars")
    records = [_record("d", i, [100.0], [50.0]) for i in range(2)]
    for i, r in enumerate(records):
        fast = r["methods"].pop("fast")
        r["methods"].update({bars.FIRST: fast, bars.DEFAULT: {**fast, "kl": 0.3},
                             bars.LAYERS6: {**fast, "kl": 0.1 + 0.1 * i}, "epic": {**fast, "kl": 0.25}})
    path = tmp_path / "p.progress.jsonl"
    path.write_text("".join(json.dumps({"key": {}, "record": r}) + "\n" for r in records))
    table = bars.table(path, subject="layers6")
    assert "| KL 6 layers | KL it |" in table and "| 6 layers |" not in table
    assert "| default | 2 | 0.1500 | 0.3000 | -0.1500" in table and "| 2 / 0 |" in table
    assert "| epic | 2 | 0.1500 | 0.2500 |" in table and "| first | 2 |" in table
    assert "| 6 layers | 2 | 0.3000 | 0.1500 | +0.1500" in bars.table(path)  # the default's bars


def test_bars_script_agreement_compares_kl_and_answers_over_the_pairs_both_runs_have():
    """--agree-with: two runs of the same examples (a GPU's and a CPU's) are compared on KL and the
    greedy answer over the (example, method) pairs both ran; full recompute, the reference, is left out."""
    bars = _script("bars")
    gpu = [{"dataset": "d", "id": "a", "methods": {"full_recompute": {"kl": 0.0, "answer": "x"},
                                                   "m": {"kl": 0.2, "answer": "x"}, "n": {"kl": 0.5, "answer": "y"}}},
           {"dataset": "d", "id": "b", "methods": {"m": {"kl": 0.1, "answer": "z"}}}]
    cpu = [{"dataset": "d", "id": "a", "methods": {"full_recompute": {"kl": 0.0, "answer": "q"},
                                                   "m": {"kl": 0.2001, "answer": "x"}, "n": {"kl": 0.5, "answer": "w"}}},
           {"dataset": "d", "id": "c", "methods": {"m": {"kl": 0.1, "answer": "z"}}}]
    a = bars.agreement(gpu, cpu)
    assert a["pairs"] == 2 and a["same_answer"] == 1
    assert abs(a["max_abs_kl_diff"] - 1e-4) < 1e-9 and abs(a["median_abs_kl_diff"] - 5e-5) < 1e-9
    assert bars.agreement(gpu[1:], cpu) is None


def test_selection_kl_summary_is_relative_to_the_named_baseline_and_names_the_variants_when_it_is_missing(tmp_path):
    """scripts/selection_kl.py --summary: the KL difference to --baseline is paired per example (with
    its interval and the examples each side wins), TTFT the mean per-example ratio to it, over the
    examples every variant has; a baseline with no rows is a clear error that lists the variants."""
    import pytest

    selection_kl = _script("selection_kl")
    rows = [{"id": "a", "variant": "p", "kl": 0.2, "ttft": 10.0, "full_ttft": 50.0, "share": 0.15, "prompt": 100},
            {"id": "a", "variant": "q", "kl": 0.1, "ttft": 20.0, "full_ttft": 50.0, "share": 0.15, "prompt": 100},
            {"id": "b", "variant": "p", "kl": 0.4, "ttft": 10.0, "full_ttft": 50.0, "share": 0.15, "prompt": 300},
            {"id": "b", "variant": "q", "kl": 0.3, "ttft": 40.0, "full_ttft": 50.0, "share": 0.15, "prompt": 300},
            {"id": "c", "variant": "p", "kl": 9.0, "ttft": 1.0, "full_ttft": 50.0, "share": 0.15, "prompt": 900}]  # q lacks c
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = selection_kl.summary([str(path)], baseline="p")
    assert "2 examples, ~200 prompt tokens" in table
    assert "| p | 0.3000 | +0.0000 (+0.0000, +0.0000) | 0 / 0 | 1.00 | 0.150 |" in table
    assert "| q | 0.2000 | -0.1000 (-0.1000, -0.1000) | 2 / 0 | 3.00 | 0.150 |" in table
    with pytest.raises(SystemExit, match="baseline 'cachetune'.*p, q"):
        selection_kl.summary([str(path)])


def test_selection_kl_plot_draws_one_panel_per_file_with_short_names_for_named_specs(tmp_path):
    """--summary --plot: compare()'s groups (one per file unless pooled) become one panel each, a
    PNG on disk; a spec named in scripts/selection_methods.sh is shown by its name, a setting added to
    it kept after the name, and any other spec as it is."""
    from PIL import Image

    selection_kl = _script("selection_kl")
    paths = []
    for n, kl in enumerate((0.1, 0.3)):
        path = tmp_path / f"set{n}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "variant": v, "kl": kl * (1 + i), "ttft": t, "full_ttft": 50.0,
                                            "share": 0.15, "prompt": 100}) + "\n"
                                for i in range(2) for v, t in (("p", 10.0), ("p:x=1", 11.0), ("q", 12.0))))
        paths.append(str(path))
    groups = selection_kl.compare(paths, baseline="p")
    assert [g["examples"] for g in groups] == [2, 2]
    assert [round(r["ttft"], 3) for r in groups[1]["rows"]] == [1.0, 1.1, 1.2]
    one = Image.open(selection_kl.plot_summary(groups[:1], tmp_path / "one.png", "t", ttft_bar=1.1))
    two = Image.open(selection_kl.plot_summary(groups, tmp_path / "two.png", "t", names={"p": "first"}))
    assert two.width > 1.8 * one.width  # a panel per group
    assert selection_kl.short_name("p:x=1", {"p": "first", "p:x": "other"}) == "first:x=1"
    assert selection_kl.short_name("pq", {"p": "first"}) == "pq"


def test_selection_kl_f1_is_each_variants_score_over_full_recomputes_from_a_progress_file(tmp_path):
    """--f1: an answers run's scores (--answers rows) and a KL run's (with full recompute's score) join
    a progress file's, whose full recompute is the reference; the ratio is of means over the examples
    every shown variant has, the first file's score standing where two files score one example; rows
    without a score and other ratios are not scores; no full recompute, or no common example, is a
    clear error."""
    import pytest

    selection_kl = _script("selection_kl")

    def record(rid, full, p):
        return {"key": {}, "record": {"id": rid, "dataset": "d", "prompt_tokens": 9, "methods": {
            "full_recompute": {"ttft_ms": [9.0], "kl": 0.0, "score": full},
            "p@0.15": {"kl": 0.1, "ttft_ms": [1.0], "recomputed_share": 0.15, "score": p},
            "p@0.3": {"kl": 0.1, "ttft_ms": [1.0], "recomputed_share": 0.3, "score": 0.0}}}}

    progress = tmp_path / "eval.progress.jsonl"
    progress.write_text("".join(json.dumps(record(*r)) + "\n" for r in (("a", 1.0, 1.0), ("b", 0.5, 0.0),
                                                                         ("c", 0.5, 0.5))))
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "a", "variant": "q", "score": 0.5, "answer": "x"},
        {"id": "b", "variant": "q", "score": 1.0, "answer": "y"},
        {"id": "b", "variant": "p", "score": 1.0, "answer": "y"},  # p on b: this file stands when it comes first
        {"id": "z", "variant": "q", "score": 1.0, "answer": "w"},  # no full recompute score on z
        {"id": "a", "variant": "k", "kl": 0.2, "ttft": 1.0, "full_ttft": 2.0, "share": 0.15, "prompt": 9},
        {"id": "y", "variant": "k", "kl": 0.2, "ttft": 1.0, "full_ttft": 2.0, "share": 0.15, "prompt": 9,
         "answer": "v", "score": 0.0, "full_score": 0.5})))  # a KL run's row: full recompute's score on y
    table = selection_kl.f1_summary([str(answers), str(progress)], ratio=0.15, only=["q", "p"])
    assert "| q | 2 | 0.750 | 0.750 | 1.00 (" in table and "| 1 / 1 |" in table  # a and b: both have them
    assert "| p | 2 | 1.000 | 0.750 | 1.33 (" in table
    assert "| k | 1 | 0.000 | 0.500 | 0.00 (" in selection_kl.f1_summary([str(answers), str(progress)], only=["k"])
    assert "| p | 3 | 0.500 | 0.667 | 0.75 (" in selection_kl.f1_summary([str(progress), str(answers)], only=["p"])
    with pytest.raises(SystemExit, match="no example has scores"):  # k's only score is on y, which q lacks
        selection_kl.f1_summary([str(answers), str(progress)], ratio=0.15)
    # Within one file a later line (a resumed run's) wins; a torn last line is skipped.
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text(json.dumps({"id": "a", "variant": "q", "score": 0.0, "answer": "x"}) + "\n"
                       + json.dumps({"id": "a", "variant": "q", "score": 1.0, "answer": "x"}) + "\n" + '{"torn')
    assert "| q | 1 | 1.000 | 1.000 | 1.00 (" in selection_kl.f1_summary([str(resumed), str(progress)], only=["q"])
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps({"id": "a", "variant": "q", "score": 0.5, "answer": "x"}) + "\n")
    with pytest.raises(SystemExit, match="no full_recompute scores"):
        selection_kl.f1_summary([str(alone)])


def test_selection_kl_summary_pools_an_eval_progress_file_with_its_own_rows_at_the_ratio(tmp_path):
    """--summary --pool: a `cachetune eval` progress file's methods at --ratio (swept labels
    "<m>@<r>" read as "<m>", other ratios left out) join this script's rows as one sample, over the
    variants both files have; an example in two files is joined, never counted twice, and refused
    where the two disagree on a KL; --only picks variants that not every file has, and each TTFT is
    taken over the full recompute timed in its own run, against the baseline's row in the same file
    where that file timed one."""
    import pytest

    selection_kl = _script("selection_kl")

    def method(kl, ms):
        return {"kl": kl, "ttft_ms": [ms], "recomputed_share": 0.15}

    record = {"id": "e1", "dataset": "d", "prompt_tokens": 500, "methods": {
        "full_recompute": {"ttft_ms": [100.0]}, "p@0.15": method(0.5, 10.0), "p@0.3": method(9.0, 1.0),
        "q@0.15": method(0.2, 30.0), "only_here": method(0.0, 1.0)}}
    progress = tmp_path / "eval.progress.jsonl"
    progress.write_text(json.dumps({"key": {}, "record": record}) + "\n" + '{"torn')

    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"share": 0.15, "prompt": 100, **r}) + "\n" for r in rows))
        return str(path)

    own = write("own.jsonl", [{"id": "e2", "variant": v, "kl": kl, "ttft": 10.0, "full_ttft": 100.0}
                              for v, kl in (("p", 0.3), ("q", 0.4))])
    table = selection_kl.summary([str(progress), own], baseline="p", ratio=0.15, pool=True)
    assert "2 examples, ~300 prompt tokens" in table
    assert "| q | 0.3000 | -0.1000 (-0.3000, +0.1000) | 1 / 1 | 2.00 | 0.150 |" in table
    assert "only_here" not in table
    pooled_twice = selection_kl.summary([own, own], baseline="p", pool=True)
    assert pooled_twice.splitlines()[1:] == selection_kl.summary([own], baseline="p").splitlines()[1:]
    # r ran in a slower run on both examples, twice p's share of its own full recompute; that run
    # also timed p on e2, at r's share, and r on e2 is compared with that p
    later = write("later.jsonl", [{"id": e, "variant": "r", "kl": 0.1, "ttft": 40.0, "full_ttft": 200.0}
                                  for e in ("e1", "e2")] + [{"id": "e2", "variant": "p", "kl": 0.3, "ttft": 40.0,
                                                             "full_ttft": 200.0}])
    table = selection_kl.summary([str(progress), own, later], baseline="p", pool=True, only=["r"])
    assert "| r | 0.1000 | -0.3000 (-0.4000, -0.2000) | 2 / 0 | 1.50 | 0.150 |" in table and "| q |" not in table
    # another CPU's float32 kernels: the same KL to the last digits is the same example, joined
    machine = write("machine.jsonl", [{"id": "e2", "variant": "p", "kl": 0.300002, "ttft": 1.0, "full_ttft": 1.0}])
    assert "1 examples" in selection_kl.summary([own, machine], baseline="p", pool=True)
    other = write("other.jsonl", [{"id": "e2", "variant": "p", "kl": 0.35, "ttft": 1.0, "full_ttft": 1.0}])
    with pytest.raises(SystemExit, match="p on e2 has KL 0.300000 in one file and 0.350000"):
        selection_kl.summary([own, other], baseline="p", pool=True)
    with pytest.raises(SystemExit, match="no rows of s"):
        selection_kl.summary([own], baseline="p", only=["s"])


def test_selection_kl_rows_picks_those_rows_of_the_set_in_order_and_refuses_rows_past_its_end():
    """scripts/selection_kl.py --rows: the named rows of the set (what a re-run of a few examples of a
    frontier needs), the same examples --limit/--skip would give at those places; a row past the
    set's end or a negative one is a clear error."""
    import pytest

    from cachetune.eval.datasets import bundled_sample_path, load_dataset

    selection_kl = _script("selection_kl")
    data = str(bundled_sample_path())
    every = load_dataset(data)
    assert [e.id for e in selection_kl.pick_rows(data, None, rows="5,1")] == [every[5].id, every[1].id]
    assert [e.id for e in selection_kl.pick_rows(data, 4, skip=2)] == [every[2].id, every[3].id]
    with pytest.raises(ValueError, match=f"has {len(every)} rows, asked for row {len(every)}"):
        selection_kl.pick_rows(data, None, rows=str(len(every)))
    with pytest.raises(ValueError, match="row numbers >= 0"):
        selection_kl.pick_rows(data, None, rows="-1")
    with pytest.raises(ValueError, match="row numbers >= 0"):
        selection_kl.pick_rows(data, None, rows="3,x")
