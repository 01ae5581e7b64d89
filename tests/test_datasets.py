import json
from pathlib import Path

import pytest

from cachetune.eval.datasets import (
    QAExample,
    bundled_sample_path,
    format_document,
    load_qa,
    shared_data_dir,
)


@pytest.fixture
def shared() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("shared/data is not next to this checkout")
    return d


def _write_json(path: Path, rows: object) -> Path:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def _row(answers: object, title: str = "") -> dict:
    return {
        "ctxs": [{"title": title, "text": "first passage"}, {"title": "", "text": "second passage"}],
        "question": "Where?",
        "answers": answers,
    }


# --- the bundled sample -----------------------------------------------------------------------


def test_bundled_sample_has_8_examples_of_10_documents() -> None:
    examples = load_qa(bundled_sample_path())
    assert len(examples) == 8
    assert [ex.id for ex in examples] == [f"musique_sample-{i}" for i in range(8)]
    for ex in examples:
        assert isinstance(ex, QAExample)
        assert len(ex.documents) == 10 and all(doc.strip() for doc in ex.documents)
        assert ex.question.strip()
        assert ex.answers and all(isinstance(a, str) and a.strip() for a in ex.answers)
    assert examples[0].question == "Where was the author of Hannibal and Scipio educated at?"
    assert examples[0].answers == ["Exeter College"]


def test_limit_keeps_the_first_rows_and_their_ids() -> None:
    assert [ex.id for ex in load_qa(bundled_sample_path(), limit=3)] == [
        "musique_sample-0",
        "musique_sample-1",
        "musique_sample-2",
    ]
    assert load_qa(bundled_sample_path(), limit=0) == []
    with pytest.raises(ValueError):
        load_qa(bundled_sample_path(), limit=-1)


def test_bundled_sample_is_the_start_of_the_shared_musique_file(shared: Path) -> None:
    full = load_qa(shared / "musique" / "musique_s.json", limit=8)
    sample = load_qa(bundled_sample_path())
    assert [(e.documents, e.question, e.answers) for e in full] == [
        (e.documents, e.question, e.answers) for e in sample
    ]


# --- document text and answer formats ---------------------------------------------------------


def test_document_is_title_newline_text_or_just_text() -> None:
    assert format_document("Paris", "capital of France") == "Paris\ncapital of France"
    assert format_document("", " capital of France") == " capital of France"


def test_titles_prefix_documents_and_missing_titles_are_allowed(tmp_path: Path) -> None:
    row = _row(["x"], title="Doc A")
    del row["ctxs"][1]["title"]  # CacheBlend samsum ctxs have no title key
    [ex] = load_qa(_write_json(tmp_path / "t.json", [row]))
    assert ex.documents == ["Doc A\nfirst passage", "second passage"]


def test_2wikimqa_answer_lists_are_flattened(tmp_path: Path) -> None:
    path = _write_json(tmp_path / "wiki.json", [_row([["Croatia"], ["Kingdom of Croatia", "Croatia"]])])
    [ex] = load_qa(path)
    assert ex.answers == ["Croatia", "Kingdom of Croatia", "Croatia"]
    assert ex.id == "wiki-0"


def test_jsonl_rows_skip_blank_lines_and_honour_limit(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(_row(["a"])), "", json.dumps(_row([["b"]])), json.dumps(_row(["c"]))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [ex.answers for ex in load_qa(path)] == [["a"], ["b"], ["c"]]
    assert [ex.answers for ex in load_qa(path, limit=2)] == [["a"], ["b"]]


# --- malformed input --------------------------------------------------------------------------

MALFORMED = {
    "top_level_object": {"ctxs": []},
    "longbench_row": [{"context": "Passage 1:\n...", "input": "q", "answers": ["a"]}],
    "ctx_without_text": [{**_row(["a"]), "ctxs": [{"title": "t"}]}],
    "empty_ctxs": [{**_row(["a"]), "ctxs": []}],
    "answers_is_a_string": [_row("Croatia")],
    "answers_not_strings": [_row([1])],
    "answers_empty": [_row([])],
    "question_empty": [{**_row(["a"]), "question": " "}],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_rows_raise_value_error_naming_the_file(tmp_path: Path, name: str) -> None:
    path = _write_json(tmp_path / f"{name}.json", MALFORMED[name])
    with pytest.raises(ValueError, match=f"{name}.json"):
        load_qa(path)


def test_invalid_json_unknown_suffix_and_bad_jsonl_line_raise_value_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("[{", encoding="utf-8")
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n", encoding="utf-8")
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(json.dumps(_row(["a"])) + "\n{nope\n", encoding="utf-8")
    for path, where in [(broken, "broken.json"), (csv, "rows.csv"), (bad_line, "bad.jsonl: line 2")]:
        with pytest.raises(ValueError, match=where):
            load_qa(path)


# --- the shared evaluation data (skipped without it) ------------------------------------------


def test_shared_data_dir_is_none_or_a_directory() -> None:
    d = shared_data_dir()
    assert d is None or (d.is_dir() and d.parts[-2:] == ("shared", "data"))


@pytest.mark.parametrize(
    ("relpath", "n_examples"),
    [("musique/musique_s.json", 150), ("2wikimqa/wikimqa_s_clean.json", 102)],
)
def test_shared_cacheblend_files_load_with_10_documents(shared: Path, relpath: str, n_examples: int) -> None:
    path = shared / relpath
    if not path.exists():
        pytest.skip(f"{relpath} is not in the shared data")
    examples = load_qa(path)
    assert len(examples) == n_examples
    assert len({ex.id for ex in examples}) == n_examples
    for ex in examples:
        assert len(ex.documents) == 10
        assert ex.question.strip() and ex.answers
        assert all(isinstance(a, str) and a.strip() for a in ex.answers)
