import json
from pathlib import Path

import pytest

from cachetune.eval.datasets import (
    DATASETS,
    MULTI_NEWS_INSTRUCTION,
    SAMSUM_DEMOS,
    SAMSUM_INSTRUCTION,
    QAExample,
    bundled_sample_path,
    format_document,
    format_samsum_demo,
    load_dataset,
    load_longbench,
    load_longbench_prompts,
    load_qa,
    load_samsum,
    rechunk,
    sentences,
    shared_data_dir,
    split_demos,
    split_passages,
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


def _write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
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


# --- LongBench passage and few-shot splitting ---------------------------------------------------


def test_split_passages_drops_headers_and_empty_pieces_only() -> None:
    context = "Passage 1:\nNEWLINE_CHAR first  \nPassage 2:\n\nPassage 10:\nsee Passage 3:\ninline\n"
    docs = split_passages(context)
    # the empty passage 2 is dropped; "Passage 3:" mid-line is text, not a header
    assert docs == ["NEWLINE_CHAR first  \n", "see Passage 3:\ninline\n"]


def test_split_demos_keeps_each_dialogue_summary_block_whole() -> None:
    demos = [format_samsum_demo("A: hi\r\nB: yo", "A greets B. "), format_samsum_demo("C: bye", "C leaves.")]
    assert demos[0] == "Dialogue: A: hi\r\nB: yo\nSummary: A greets B. \n"
    assert split_demos("".join(demos)) == demos


# --- IRCoT HotpotQA ------------------------------------------------------------------------------


def _ircot_row(spans: list, contexts: list | None = None) -> dict:
    return {
        "question_id": "5a8c",
        "question_text": "Who?",
        "answers_objects": [{"number": "", "date": {"day": "", "month": "", "year": ""}, "spans": spans}],
        "contexts": contexts if contexts is not None else [
            {"id": "0", "title": "Shirley Temple", "paragraph_text": "An actress.  And diplomat.",
             "is_supporting": True},
            {"id": "1", "title": "", "paragraph_text": " untitled", "is_supporting": False},
        ],
    }


def test_ircot_rows_become_title_paragraph_documents_and_span_answers(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "dev_subsampled.jsonl", [_ircot_row(["Chief of Protocol"])])
    [ex] = load_dataset(str(path))
    assert ex == QAExample(
        id="dev_subsampled-0",
        documents=["Shirley Temple\nAn actress.  And diplomat.", " untitled"],
        question="Who?",
        answers=["Chief of Protocol"],
        task="qa",
        supporting=(0,),  # the paragraphs labelled is_supporting (training keeps them in every draw)
    )


def test_ircot_spans_given_as_one_string_are_one_answer(tmp_path: Path) -> None:
    row = _ircot_row([])
    row["answers_objects"] = [{"spans": "Chief of Protocol"}, {"spans": ["Ambassador", "Diplomat"]}]
    path = _write_jsonl(tmp_path / "dev_subsampled.jsonl", [row])
    [ex] = load_dataset(str(path))
    assert ex.answers == ["Chief of Protocol", "Ambassador", "Diplomat"]


@pytest.mark.parametrize("spans", ["", "   ", 7, {"text": "a"}, ["ok", 3], [""]])
def test_ircot_spans_that_are_not_non_empty_strings_are_rejected(tmp_path: Path, spans: object) -> None:
    row = _ircot_row([])
    row["answers_objects"] = [{"spans": spans}]
    path = _write_jsonl(tmp_path / "bad_spans.jsonl", [row])
    with pytest.raises(ValueError, match=r"bad_spans\.jsonl: row 0: 'answers_objects'.*'spans'"):
        load_dataset(str(path))


# --- LongBench jsonl (multi_news) -------------------------------------------------------------------


def _lb_row(context: str, dataset: str = "multi_news", inp: str = "") -> dict:
    return {"input": inp, "context": context, "answers": ["A summary."], "length": 9, "dataset": dataset,
            "language": "en", "all_classes": None, "_id": "e45a"}


def test_multi_news_splits_passages_and_asks_for_a_summary(tmp_path: Path) -> None:
    context = "Passage 1:\nOccupy LA NEWLINE_CHAR NEWLINE_CHAR stays.\nPassage 2:\nPhilly too.\n"
    path = _write_jsonl(tmp_path / "multi_news.jsonl", [_lb_row(context)])
    [ex] = load_dataset(str(path))
    assert ex.documents == ["Occupy LA NEWLINE_CHAR NEWLINE_CHAR stays.\n", "Philly too.\n"]
    assert "".join(f"Passage {i}:\n{d}" for i, d in enumerate(ex.documents, 1)) == context  # byte-for-byte
    assert (ex.question, ex.answers, ex.task) == (MULTI_NEWS_INSTRUCTION, ["A summary."], "summarization")


def test_longbench_qa_rows_use_the_input_as_question(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", [_lb_row("Passage 1:\nT\nx\n", "hotpotqa", "Who?")])
    [ex] = load_longbench(path)
    assert (ex.documents, ex.question, ex.task) == (["T\nx\n"], "Who?", "qa")


# --- SAMSum few-shot --------------------------------------------------------------------------------


def _samsum_dir(tmp_path: Path, n_test: int = 5, n_val: int = 12) -> Path:
    _write_jsonl(tmp_path / "validation.jsonl",
                 [{"context": f"V{j}: hi\r\nW: ok", "response": f"sum {j}. "} for j in range(n_val)])
    queries = [{"context": f"T{i}: q", "response": f"gold {i}"} for i in range(n_test)]
    return _write_jsonl(tmp_path / "test.jsonl", queries)


def test_samsum_examples_are_demos_from_the_pool_then_the_query(tmp_path: Path) -> None:
    test = _samsum_dir(tmp_path)
    examples = load_samsum(test, demos=4, pool=6)
    pool = [format_samsum_demo(f"V{j}: hi\r\nW: ok", f"sum {j}. ") for j in range(6)]
    for i, ex in enumerate(examples):
        assert ex.id == f"test-{i}" and ex.task == "summarization" and ex.answers == [f"gold {i}"]
        assert len(ex.documents) == 4 and len(set(ex.documents)) == 4 and set(ex.documents) <= set(pool)
        assert ex.question == f"{SAMSUM_INSTRUCTION}\n\nDialogue: T{i}: q\nSummary:"
    assert len({tuple(ex.documents) for ex in examples}) > 1  # demos differ per example...
    assert load_samsum(test, demos=4, pool=6) == examples  # ...deterministically
    assert load_samsum(test, limit=2, demos=4, pool=6) == examples[:2]  # and independent of limit


def test_samsum_needs_its_validation_demos(tmp_path: Path) -> None:
    test = _samsum_dir(tmp_path, n_val=3)
    with pytest.raises(ValueError, match="3"):
        load_samsum(test, demos=4)
    (tmp_path / "validation.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="validation.jsonl"):
        load_dataset(str(test))


# --- MiniLongBench prompts ---------------------------------------------------------------------------

QA_HEAD = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
QA_PROMPT = (f"{QA_HEAD}\n\nThe following are given passages.\nPassage 1:\nWilburys\nA band.\n\nMore.\n"
             f"Passage 2:\nDylan\nA singer.\n\n{QA_HEAD}\n\nQuestion: Who?\nAnswer:")
NEWS_PROMPT = ("You are given several news passages. Write a one-page summary of all news. \n\nNews:\nPassage 1:\nA.\n"
               "Passage 2:\nB.\n\n\nNow, write a one-page summary of all the news.\n\nSummary:\n")
SAMSUM_PROMPT = ("Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
                 "Dialogue: A: hi\r\nB: yo\nSummary: A greets. \nDialogue: C: x\nSummary: C.\n"
                 "\n\nDialogue: D: q\nSummary: ")


def _mini(tmp_path: Path, name: str, prompt: str, gold: object) -> Path:
    item = {"origin_prompt": prompt, "prediction": "ignored", "gold": gold, "time": "1"}
    return _write_json(tmp_path / f"MiniLongBench_{name}.json", {"0": item, "1": item})


def test_minilongbench_qa_prompt_splits_into_passages_and_the_tail(tmp_path: Path) -> None:
    path = _mini(tmp_path, "hotpotqa", QA_PROMPT, "['Bob Dylan', \"O'Brien\"]")  # a Python repr, not JSON
    ex = load_dataset(str(path))[1]
    assert ex.id == "MiniLongBench_hotpotqa-1" and ex.task == "qa"
    assert ex.documents == ["Wilburys\nA band.\n\nMore.\n", "Dylan\nA singer."]
    assert ex.question == f"{QA_HEAD}\n\nQuestion: Who?\nAnswer:"
    assert ex.answers == ["Bob Dylan", "O'Brien"]


def test_minilongbench_summarization_prompts(tmp_path: Path) -> None:
    [news, _] = load_longbench_prompts(_mini(tmp_path, "multi_news", NEWS_PROMPT, ["S."]))
    assert (news.documents, news.task) == (["A.\n", "B.\n"], "summarization")
    assert news.question == "Now, write a one-page summary of all the news.\n\nSummary:\n"
    [sam] = load_longbench_prompts(_mini(tmp_path, "samsum", SAMSUM_PROMPT, "['D asks.']"), limit=1)
    assert sam.documents == ["Dialogue: A: hi\r\nB: yo\nSummary: A greets. \n", "Dialogue: C: x\nSummary: C.\n"]
    assert (sam.question, sam.answers) == ("Dialogue: D: q\nSummary: ", ["D asks."])


# --- the registry and load_dataset -------------------------------------------------------------------


def test_registry_names_resolve_under_data_dir_with_stable_ids(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / DATASETS["hotpotqa"].path, [_ircot_row([f"a{i}"]) for i in range(4)])
    full = load_dataset("hotpotqa", data_dir=tmp_path)
    assert [ex.id for ex in full] == [f"hotpotqa-{i}" for i in range(4)]
    assert load_dataset("hotpotqa", limit=2, data_dir=tmp_path) == full[:2]


def test_registry_covers_every_shared_file() -> None:
    assert set(DATASETS) == {"musique", "2wikimqa", "hotpotqa", "hotpotqa_heldout", "hotpotqa_train", "multi_news",
                             "samsum", "lb_hotpotqa", "lb_2wikimqa", "lb_musique", "lb_samsum", "lb_multi_news"}
    assert {spec.task for spec in DATASETS.values()} == {"qa", "summarization"}


def test_missing_dataset_file_names_the_expected_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="multi_news/multi_news.jsonl"):
        load_dataset("multi_news", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a file nor a dataset"):
        load_dataset("no_such_set")


def test_cacheblend_file_paths_load_as_before(tmp_path: Path) -> None:
    path = _write_json(tmp_path / "wiki.json", [_row([["Croatia"]])])
    assert load_dataset(str(path)) == load_qa(path)


NEW_FORMAT_MALFORMED = {
    "ircot_no_spans.jsonl": [_ircot_row([])],
    "ircot_bad_context.jsonl": [_ircot_row(["a"], contexts=[{"title": "t"}])],
    "longbench_no_passages.jsonl": [_lb_row("no headers here", "hotpotqa", "q")],
    "samsum_no_summary.jsonl": [{"context": "A: hi", "response": ""}],
    "unknown_keys.jsonl": [{"text": "x"}],
    "MiniLongBench_bad_gold.json": {"0": {"origin_prompt": QA_PROMPT, "gold": "['unclosed"}},
    "MiniLongBench_other_task.json": {"0": {"origin_prompt": "Translate this.", "gold": "['x']"}},
}


@pytest.mark.parametrize("name", sorted(NEW_FORMAT_MALFORMED))
def test_malformed_rows_of_every_format_raise_value_error_naming_the_file(tmp_path: Path, name: str) -> None:
    rows = NEW_FORMAT_MALFORMED[name]
    path = _write_json(tmp_path / name, rows) if name.endswith(".json") else _write_jsonl(tmp_path / name, rows)
    if name.startswith("samsum"):
        _write_jsonl(tmp_path / "validation.jsonl", [{"context": "A: hi", "response": "ok"}] * SAMSUM_DEMOS)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_dataset(str(path))


# --- every registered shared dataset (skipped without shared/data) ------------------------------------

SHARED_SIZES = {"musique": 150, "2wikimqa": 102, "hotpotqa": 500, "hotpotqa_heldout": 100, "hotpotqa_train": 400,
                "multi_news": 200, "samsum": 819,
                "lb_hotpotqa": 13, "lb_2wikimqa": 13, "lb_musique": 7, "lb_samsum": 15, "lb_multi_news": 11}
DOCS_PER_EXAMPLE = {"musique": 10, "2wikimqa": 10, "hotpotqa": 10, "hotpotqa_heldout": 10, "hotpotqa_train": 10,
                    "samsum": SAMSUM_DEMOS}


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_first_examples_of_every_shared_dataset(shared: Path, name: str) -> None:
    examples = load_dataset(name, limit=3)
    if name not in ("hotpotqa_heldout", "hotpotqa_train"):  # ids are file rows: the splits are subsets
        assert [ex.id for ex in examples] == [f"{name}-{i}" for i in range(3)]
    for ex in examples:
        assert ex.task == DATASETS[name].task
        assert ex.documents and all(doc.strip() for doc in ex.documents)
        assert len(ex.documents) == DOCS_PER_EXAMPLE.get(name, len(ex.documents))
        assert ex.question.strip() and ex.answers and all(a.strip() for a in ex.answers)


def test_heldout_hotpotqa_is_the_split_training_never_reads(shared: Path) -> None:
    from cachetune.train.data import load_split

    heldout = load_dataset("hotpotqa_heldout")
    split = load_split()
    rows = [int(ex.id.rsplit("-", 1)[1]) for ex in heldout]
    assert rows == sorted(rows) and len(set(rows)) == 100
    assert [ex.documents for ex in heldout] == [ex.documents for ex in split.heldout]
    trained = {tuple(ex.documents) for ex in split.train}
    assert not any(tuple(ex.documents) in trained for ex in heldout)
    assert [ex.id for ex in load_dataset("hotpotqa_heldout", limit=5)] == [ex.id for ex in heldout[:5]]
    tuning = load_dataset("hotpotqa_train")
    assert [ex.documents for ex in tuning] == [ex.documents for ex in split.train]
    assert not {ex.id for ex in tuning} & {ex.id for ex in heldout}


def test_shared_dataset_sizes_match_the_readme(shared: Path) -> None:
    assert {name: len(load_dataset(name)) for name in DATASETS} == SHARED_SIZES


def test_minilongbench_news_passages_equal_the_longbench_jsonl_split(shared: Path) -> None:
    # MiniLongBench items are LongBench multi_news test rows, so both loaders must cut the same chunks.
    full = {tuple(ex.documents): ex.answers for ex in load_dataset("multi_news")}
    for ex in load_dataset("lb_multi_news"):
        assert full[tuple(ex.documents)] == ex.answers


def test_data_dir_can_be_moved_with_an_environment_variable(tmp_path, monkeypatch):
    (tmp_path / "musique").mkdir()
    (tmp_path / "musique" / "musique_s.json").write_text(bundled_sample_path().read_text())
    monkeypatch.setenv("CACHETUNE_DATA_DIR", str(tmp_path))
    assert shared_data_dir() == tmp_path
    assert [ex.id for ex in load_dataset("musique", limit=2)] == ["musique-0", "musique-1"]
    monkeypatch.setenv("CACHETUNE_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        load_dataset("musique")


def test_sentences_keep_every_character_and_end_at_stops_and_line_breaks() -> None:
    text = "Title line\nFirst sentence. Second one!  Third?\n\nA paragraph\n\nNo end"
    pieces = sentences(text)
    assert "".join(pieces) == text
    assert pieces == ["Title line\nFirst sentence. ", "Second one!  ", "Third?\n\n", "A paragraph\n\n", "No end"]


def test_rechunk_packs_whole_sentences_up_to_the_length_across_documents() -> None:
    example = QAExample("set-0", ["T1\nA a. B b b. C.", "T2\nD d d d d d d. E e."], "q?", ["a"], supporting=(0,))

    def words(text: str) -> int:
        return len(text.split())

    chunks = rechunk(example, 4, words)
    assert chunks.id == "set-0@4t" and chunks.question == "q?" and chunks.supporting == ()
    # A title stays with its first sentence; a sentence longer than the length stands alone.
    assert chunks.documents == ["T1\nA a.", "B b b. C.", "T2\nD d d d d d d.", "E e."]
    assert "".join(c.replace("\n", "").replace(" ", "") for c in chunks.documents) == \
        "".join(d.replace("\n", "").replace(" ", "") for d in example.documents)
    assert rechunk(example, 100, words).documents == ["T1\nA a. B b b. C.\n\nT2\nD d d d d d d. E e."]
    with pytest.raises(ValueError, match="positive"):
        rechunk(example, 0, words)
