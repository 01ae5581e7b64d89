"""The analysis scripts of this experiment (bars.py, selection_kl.py) on hand-made progress files (no
model). Not part of `make test` (it runs tests/ only): run them with
`.venv/bin/python -m pytest -q experiments/selection`."""

from __future__ import annotations

import json

import pytest


def _record(dataset, i, ttft_full, ttft_fast, score_fast=0.5):
    return {"id": f"x-{i}", "dataset": dataset, "task": "qa", "prompt_tokens": 100, "methods": {
        "full_recompute": {"ttft_ms": ttft_full, "kl": 0.0, "top1": [1.0, 1.0], "match": 1.0, "score": 1.0,
                           "recomputed_share": 1.0, "answer": "a"},
        "fast": {"ttft_ms": ttft_fast, "kl": 0.2, "top1": [1.0, 0.0], "match": 0.0, "score": score_fast,
                 "recomputed_share": 0.15, "answer": "b"},
    }}


def _script(name: str):
    """<name>.py of this folder loaded as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bars_script_reads_an_example_once_with_its_last_record_and_skips_a_torn_line(tmp_path):
    """A resumed run appends an example again with the variants it added: bars.py must count
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
    """selection_kl.py --summary: the KL difference to --baseline is paired per example (with
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
    """selection_kl.py --rows: the named rows of the set (what a re-run of a few examples of a
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
