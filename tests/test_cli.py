"""The command line as a user runs it (`ask`, `bench`, `eval`, `analyze`) on the bundled model."""

from __future__ import annotations

import json

import pytest
import torch

from cachetune.cli import main
from cachetune.config import EngineConfig
from cachetune.engine.calibration import device_identity

pytestmark = pytest.mark.real_model

DOCS = [
    "The Amazon river flows through Brazil, Peru and Colombia.",
    "Mount Kilimanjaro is the highest mountain in Africa; it stands in Tanzania.",
    "The Eiffel Tower was completed in 1889 in Paris.",
]


@pytest.fixture
def qa_file(tmp_path):
    rows = [{"ctxs": [{"title": "", "text": d} for d in DOCS],
             "question": "In which country is Mount Kilimanjaro?", "answers": ["Tanzania"]}]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(rows))
    return path


def _rows(report):
    (dataset,) = report["datasets"].values()
    return {r["method"]: r for r in dataset["results"]}


def test_bench_writes_report_with_required_fields(qa_file, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["bench", "--data", str(qa_file), "--methods", "full_reuse,cachetune", "--ratio", "1.0",
                 "--max-new-tokens", "6", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["model"] == "smollm2-135m" and report["datasets"]["qa"]["n_examples"] == 1
    rows = _rows(report)
    assert set(rows) == {"full_recompute", "full_reuse", "cachetune"}  # the reference is always added
    for row in rows.values():
        for key in ("quality", "ttft_ms_median", "ttft_ms_p95", "speedup_vs_full", "kl_to_full", "top1_agree",
                    "answer_match_full", "recomputed_share"):
            assert isinstance(row[key], float)
    assert rows["full_recompute"]["speedup_vs_full"] == 1.0 and rows["full_recompute"]["kl_to_full"] == 0.0
    # Recomputing every chunk token is exact: it must agree with full recompute everywhere.
    assert rows["cachetune"]["kl_to_full"] < 1e-5
    assert rows["cachetune"]["top1_agree"] == 1.0 and rows["cachetune"]["answer_match_full"] == 1.0
    assert rows["full_reuse"]["recomputed_share"] == 0.0
    assert "| cachetune |" in out.with_suffix(".md").read_text()
    assert "| full_reuse |" in capsys.readouterr().out


def test_eval_runs_every_method_and_exact_ones_match_full(qa_file, tmp_path):
    out = tmp_path / "eval.json"
    plots = tmp_path / "plots"
    code = main(["eval", "--data", str(qa_file), "--methods", "all", "--ratio", "1.0", "--max-new-tokens", "4",
                 "--json", str(out), "--plots", str(plots)])
    assert code == 0
    report = json.loads(out.read_text())
    rows = _rows(report)
    from cachetune.methods import method_names

    # "all" is every registered method, less trained ones whose weights do not exist for this model.
    assert set(rows) | set(report["skipped"]) == set(method_names())
    assert set(report["skipped"]) <= {"c2kv", "kvlink", "block_attention"}
    assert all("train" in why for why in report["skipped"].values())
    # Lossless or fully recomputing at r = 1: the same next-token distribution as full recompute.
    for method in ("prefix", "cachetune", "cacheblend", "prophetkv", "random", "l2", "highfreq", "lf_only"):
        assert rows[method]["kl_to_full"] < 1e-4, method
        assert rows[method]["answer_match_full"] == 1.0, method
    assert rows["prefix"]["recomputed_share"] < 1.0  # the first document came from the prefix cache
    assert rows["epic"]["recomputed_share"] < 1.0 and rows["ape"]["recomputed_share"] == 0.0
    assert (plots / "quality_vs_ttft.png").stat().st_size > 0 and (plots / "fidelity_vs_ttft.png").exists()


def test_eval_resumes_from_its_progress_file(qa_file, tmp_path):
    out = tmp_path / "eval.json"
    args = ["eval", "--data", str(qa_file), "--methods", "full_reuse", "--max-new-tokens", "3", "--json", str(out)]
    assert main(args) == 0
    first = json.loads(out.read_text())["examples"]
    assert main(args) == 0  # nothing left to run: the recorded example is reused as is
    assert json.loads(out.read_text())["examples"] == first
    assert main([*args, "--fresh"]) == 0
    assert json.loads(out.read_text())["examples"][0]["methods"]["full_reuse"]["ttft_ms"] != \
        first[0]["methods"]["full_reuse"]["ttft_ms"]
    # A progress file written with other settings is refused, not mixed in.
    assert main([*args[:-4], "--max-new-tokens", "5", "--json", str(out)]) == 2


def test_eval_adds_only_the_missing_methods_to_resumed_examples(qa_file, tmp_path):
    out = tmp_path / "eval.json"
    base = ["eval", "--data", str(qa_file), "--max-new-tokens", "3", "--json", str(out), "--ranking", "lf"]
    assert main([*base, "--methods", "full_reuse"]) == 0
    first = json.loads(out.read_text())["examples"][0]["methods"]
    assert main([*base, "--methods", "full_reuse,cachetune:first"]) == 0
    grown = json.loads(out.read_text())["examples"][0]["methods"]
    assert grown["full_reuse"] == first["full_reuse"] and grown["full_recompute"] == first["full_recompute"]
    assert set(grown) == {"full_recompute", "full_reuse", "cachetune:first"}
    assert len(grown["cachetune:first"]["full_ttft_ms"]) == 1  # its own reference timing
    # Every timing names the machine and threads it was measured with (resumed runs may mix machines).
    device = EngineConfig().torch_device  # the CLI's default device
    here = device_identity(device)
    assert {m["device"] for m in grown.values()} == {here} and here.startswith(f"{device.type}:")


def test_eval_retimes_named_methods_beside_the_ones_a_resumed_run_adds(qa_file, tmp_path):
    out = tmp_path / "eval.json"
    base = ["eval", "--data", str(qa_file), "--max-new-tokens", "3", "--json", str(out), "--retime", "full_reuse"]
    assert main([*base, "--methods", "full_reuse"]) == 0
    first = json.loads(out.read_text())["examples"][0]["methods"]
    assert main([*base, "--methods", "full_reuse"]) == 0  # nothing added: nothing runs again
    assert json.loads(out.read_text())["examples"][0]["methods"] == first
    assert main([*base, "--methods", "full_reuse,epic"]) == 0
    grown = json.loads(out.read_text())["examples"][0]["methods"]
    assert set(grown) == {"full_recompute", "full_reuse", "epic"}
    # full_reuse ran again in the pass that added epic: both against the full recompute timed there.
    assert grown["full_reuse"]["full_ttft_ms"] == grown["epic"]["full_ttft_ms"]
    assert grown["full_reuse"]["ttft_ms"] != first["full_reuse"]["ttft_ms"]
    assert grown["full_reuse"]["kl"] == pytest.approx(first["full_reuse"]["kl"], abs=1e-6)
    assert grown["full_recompute"] == first["full_recompute"]
    assert main([*base[:-2], "--retime", "no_such_method", "--methods", "full_reuse"]) == 2


def test_eval_reruns_named_methods_whose_records_were_made_with_other_settings(qa_file, tmp_path):
    """--rerun: a resumed example runs a method again where its record names other settings than the
    method has now (a record from before a default changed), beside a fresh full recompute, and
    replaces it; run again, nothing repeats, so an interrupted rerun resumes."""
    out = tmp_path / "eval.json"
    progress = out.with_suffix(".progress.jsonl")
    base = ["eval", "--data", str(qa_file), "--max-new-tokens", "3", "--json", str(out),
            "--methods", "full_reuse,epic", "--rerun", "epic"]
    assert main(base) == 0
    first = json.loads(out.read_text())["examples"][0]["methods"]
    assert main(base) == 0  # every record made with today's settings: nothing runs
    assert json.loads(out.read_text())["examples"][0]["methods"] == first
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    for row in rows:  # as if the first run had used another setting of epic
        row["record"]["methods"]["epic"]["settings"] = {"ratio": 0.5}
    progress.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(base) == 0
    rerun = json.loads(out.read_text())["examples"][0]["methods"]
    assert rerun["epic"]["settings"] == first["epic"]["settings"] and rerun["epic"]["ttft_ms"] != first["epic"]["ttft_ms"]
    assert rerun["epic"]["full_ttft_ms"] != [first["full_recompute"]["ttft_ms"][0]]  # against the fresh full recompute
    assert rerun["full_reuse"] == first["full_reuse"] and rerun["full_recompute"] == first["full_recompute"]
    assert main(base) == 0
    assert json.loads(out.read_text())["examples"][0]["methods"] == rerun
    assert main([*base[:-2], "--rerun", "no_such_method"]) == 2


def test_eval_runs_ratio_methods_once_per_ratio(qa_file, tmp_path):
    out = tmp_path / "eval.json"
    code = main(["eval", "--data", str(qa_file), "--methods", "epic,cacheblend,cachetune:probe", "--ratios",
                 "0.1,1.0", "--max-new-tokens", "3", "--json", str(out), "--plots", str(tmp_path)])
    assert code == 0
    rows = _rows(json.loads(out.read_text()))
    assert set(rows) == {"full_recompute", "epic", "cacheblend@0.1", "cacheblend@1", "cachetune:probe@0.1",
                         "cachetune:probe@1"}
    assert rows["cachetune:probe@1"]["kl_to_full"] < 1e-4 and rows["cacheblend@1"]["kl_to_full"] < 1e-4
    assert rows["cachetune:probe@0.1"]["recomputed_share"] < 0.2
    assert (tmp_path / "fidelity_vs_ratio.png").stat().st_size > 0


def test_eval_sweeps_other_ratios_only_on_the_first_examples(tmp_path):
    rows = [{"ctxs": [{"title": "", "text": d} for d in DOCS], "question": q, "answers": [a]}
            for q, a in [("In which country is Mount Kilimanjaro?", "Tanzania"), ("What is Paris?", "a city")]]
    data = tmp_path / "qa2.json"
    data.write_text(json.dumps(rows))
    out = tmp_path / "eval.json"
    code = main(["eval", "--data", str(data), "--methods", "full_reuse,cachetune:first", "--ratios", "0.1,0.15",
                 "--sweep-examples", "1", "--max-new-tokens", "2", "--json", str(out), "--plots", str(tmp_path)])
    assert code == 0
    report = json.loads(out.read_text())
    first, second = (set(r["methods"]) for r in report["examples"])
    assert "cachetune:first@0.1" in first and "cachetune:first@0.1" not in second
    assert {"full_recompute", "full_reuse", "cachetune:first@0.15"} <= second
    counts = {m: r["n_examples"] for m, r in _rows(report).items()}
    assert counts["cachetune:first@0.15"] == 2 and counts["cachetune:first@0.1"] == 1
    (sweep,) = report["frontier"].values()  # the frontier compares variants on the same examples
    assert sweep["n_examples"] == 1
    assert "n_examples" in out.with_suffix(".md").read_text()


def test_drift_reports_recall_per_ratio_and_offline_cost(qa_file, tmp_path):
    code = main(["analyze", "drift", "--data", str(qa_file), "--rankers", "lf,first,probe,first+probe",
                 "--ratios", "0.3", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "drift.json").read_text())
    assert set(report["recall"]) == {"lf", "first", "probe", "first+probe"}
    assert set(report["recall_by_ratio"]) == {"0.15", "0.3"}
    cost = report["offline_cost"]
    assert cost["probe"]["ms_per_chunk"] > cost["first"]["ms_per_chunk"] and cost["probe"]["times_encode"] > 0.3
    assert "x encode" in (tmp_path / "drift.md").read_text()


@pytest.mark.parametrize("analysis", ["drift", "spectrum", "attention", "sweep", "robustness"])
def test_analyze_writes_json_table_and_plot(qa_file, tmp_path, analysis):
    code = main(["analyze", analysis, "--data", str(qa_file), "--limit", "1", "--max-new-tokens", "2",
                 "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / f"{analysis}.json").read_text())
    assert report["model"] == "smollm2-135m"
    assert (tmp_path / f"{analysis}.png").stat().st_size > 0 and (tmp_path / f"{analysis}.md").read_text()
    if analysis == "robustness":
        assert len(report["datasets"]) == 5
    if analysis == "sweep":
        labels = {r["method"] for r in report["datasets"]["qa"]["results"]}
        assert {"r=0.05", "r=0.4", "alpha=0.1", "alpha=1"} <= labels


def test_ask_prints_answer_and_ttft(tmp_path, capsys):
    paths = []
    for i, doc in enumerate(DOCS):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(doc)
        paths += ["--doc", str(p)]
    code = main(["ask", *paths, "--question", "Where is Kilimanjaro?", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.strip()
    assert "TTFT" in captured.err and "cachetune" in captured.err


def test_bad_input_exits_with_a_clear_error(tmp_path, qa_file, capsys):
    assert main(["bench", "--data", str(tmp_path / "missing.json")]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["bench", "--data", str(qa_file), "--methods", "nope", "--limit", "1"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_calibrate_stores_a_ratio_that_ask_with_ratio_auto_then_uses(tmp_path, qa_file, capsys):
    tier, calibration = f"disk:{tmp_path / 'kv'}", str(tmp_path / "calibration.json")
    code = main(["calibrate", "--tier", tier, "--throttle", "20MB/s", "--data", str(qa_file), "--limit", "1",
                 "--repeats", "1", "--eps", "0.1", "--calibration", calibration, "--json", str(tmp_path / "cal.json")])
    assert code == 0
    report = json.loads((tmp_path / "cal.json").read_text())
    assert 0.15 <= report["ratio"] <= 1.0 and report["tier"].endswith("@20MB/s") and report["probes"]
    entries = json.loads((tmp_path / "calibration.json").read_text())["entries"]
    assert [e["ratio"] for e in entries.values()] == [report["ratio"]]
    docs = []
    for i, doc in enumerate(DOCS):
        (tmp_path / f"d{i}.txt").write_text(doc)
        docs += ["--doc", str(tmp_path / f"d{i}.txt")]
    capsys.readouterr()
    ask = ["ask", *docs, "--question", "Where is Kilimanjaro?", "--max-new-tokens", "4", "--ratio", "auto",
           "--tiers", f"{tier}@20MB/s", "--calibration", calibration]
    assert main([*ask, "--length-floors", ""]) == 0
    assert f"[cachetune r={report['ratio']:.3g}]" in capsys.readouterr().err
    # These documents are short: by default "auto" keeps at least the floor for their length.
    assert main([*ask, "--length-floors", "512:0.9"]) == 0
    assert "[cachetune r=0.9]" in capsys.readouterr().err
    assert main(["calibrate", "--tier", "cpu,disk", "--data", str(qa_file)]) == 2  # one tier at a time


def test_calibrate_price_writes_its_report_and_stores_the_measured_scale(tmp_path, qa_file, capsys):
    calibration = tmp_path / "calibration.json"
    code = main(["calibrate-price", "--data", str(qa_file), "--limit", "1", "--repeats", "1",
                 "--calibration", str(calibration), "--json", str(tmp_path / "price.json")])
    assert code == 0
    report = json.loads((tmp_path / "price.json").read_text())
    (prompt,) = report["prompts"]
    assert prompt["first_s"] > 0 and prompt["deep_s"] > 0 and prompt["predicted"] > 0
    assert "measured price" in capsys.readouterr().out
    (entry,) = json.loads(calibration.read_text())["entries"].values()
    assert entry["scale"] == report["scale"] and entry["key"]["kind"] == "price"
    assert entry["key"]["device"] == device_identity(torch.device("cpu"))
