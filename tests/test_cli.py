"""The command line as a user runs it (`cachetune ask`, `cachetune bench`) on the bundled model."""

from __future__ import annotations

import json

import pytest

from cachetune.cli import main

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


def test_bench_writes_report_with_required_fields(qa_file, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["bench", "--data", str(qa_file), "--methods", "full_reuse,cachetune", "--ratio", "1.0",
                 "--max-new-tokens", "6", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["model"] == "smollm2-135m" and report["n_examples"] == 1
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"full_recompute", "full_reuse", "cachetune"}  # the reference is always added
    for row in rows.values():
        for key in ("ratio", "ttft_ms_median", "speedup_vs_full", "kl_to_full", "top1_agree",
                    "answer_match_full", "f1"):
            assert isinstance(row[key], float)
    assert rows["full_recompute"]["speedup_vs_full"] == 1.0 and rows["full_recompute"]["kl_to_full"] == 0.0
    # Recomputing every chunk token is exact: it must agree with full recompute everywhere.
    assert rows["cachetune"]["kl_to_full"] < 1e-5
    assert rows["cachetune"]["top1_agree"] == 1.0 and rows["cachetune"]["answer_match_full"] == 1.0
    assert rows["full_reuse"]["ratio"] == 0.0 and rows["full_reuse"]["recomputed_share"] == 0.0
    assert "| cachetune |" in out.with_suffix(".md").read_text()
    assert "| full_reuse |" in capsys.readouterr().out


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
