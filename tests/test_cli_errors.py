"""Errors a user can cause end the CLI with one `cachetune: error: ...` line and exit code 2, never a
traceback. Every case fails before a real model loads (or on a tiny broken file), so these are fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachetune.cli import build_parser, main
from cachetune.cli.common import datasets as cli_datasets
from cachetune.eval.datasets import bundled_sample_path, load_dataset


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GGUF given with --model is converted under the cache dir: keep it out of the user's home.
    monkeypatch.setenv("CACHETUNE_HOME", str(tmp_path / "home"))


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text("Mount Kilimanjaro stands in Tanzania.")
    return path


def _ask(doc: Path, *extra: str) -> list[str]:
    return ["ask", "--doc", str(doc), "--question", "Where?", *extra]


def _no_model(tmp_path: Path) -> list[str]:
    # Where the error must come before the model loads: had it not, this would be the error instead.
    return ["--model", str(tmp_path / "no-such-model")]


def assert_one_error_line(code: int, capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachetune: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_model_dir_with_broken_safetensors(tmp_path: Path, doc: Path, capsys) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" * 8)
    code = main(_ask(doc, "--model", str(model_dir)))
    assert_one_error_line(code, capsys, "model.safetensors", "corrupt or truncated")


def test_gguf_with_valid_magic_and_garbage_after_it(tmp_path: Path, doc: Path, capsys) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 256)
    code = main(_ask(doc, "--model", str(gguf)))
    assert_one_error_line(code, capsys, str(gguf), "GGUF")


def test_config_file_with_a_wrong_typed_value(tmp_path: Path, doc: Path, capsys) -> None:
    # Needs EngineConfig's type validation (a ValueError); a bare `"two" < 1` TypeError is a traceback.
    config = tmp_path / "engine.toml"
    config.write_text('threads = "two"\n')
    code = main(_ask(doc, "--config", str(config), *_no_model(tmp_path)))
    assert_one_error_line(code, capsys, "threads")


def test_data_file_without_examples(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code = main(["eval", "--data", str(empty), "--methods", "full_reuse", *_no_model(tmp_path)])
    assert_one_error_line(code, capsys, "'empty'", "no examples")


@pytest.mark.parametrize("lengths", ["0", "128,x", ""])
def test_chunk_lengths_must_be_positive_token_counts(tmp_path: Path, capsys, lengths: str) -> None:
    with pytest.raises(SystemExit) as exit_:  # argparse's own error: the usage, then one error line
        main(["eval", "--chunk-tokens", lengths, *_no_model(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error: argument --chunk-tokens" in last and "positive token counts" in last


def test_limit_zero_leaves_no_examples(tmp_path: Path, capsys) -> None:
    code = main(["bench", "--limit", "0", *_no_model(tmp_path)])  # the bundled sample, cut to nothing
    assert_one_error_line(code, capsys, "no examples", "--limit 0")


def test_missing_config_file(tmp_path: Path, doc: Path, capsys) -> None:
    code = main(_ask(doc, "--config", str(tmp_path / "missing.toml")))
    assert_one_error_line(code, capsys, "missing.toml")


def test_malformed_data_row(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_text": "q", "contexts": []}\n')  # an IRCoT row without answers_objects
    code = main(["eval", "--data", str(bad), *_no_model(tmp_path)])
    assert_one_error_line(code, capsys, "bad.jsonl", "answers_objects")


# --- dataset names --------------------------------------------------------------------------------


def _copy_sample(path: Path, rows: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json.loads(bundled_sample_path().read_text())[:rows]))
    return path


def test_data_files_with_the_same_stem_keep_distinct_stable_names(tmp_path: Path) -> None:
    a = _copy_sample(tmp_path / "a" / "musique.json", 1)
    b = _copy_sample(tmp_path / "b" / "musique.json", 2)
    args = build_parser().parse_args(["eval", "--data", f"{a},{b}", "--data", str(a)])
    datasets = cli_datasets(args, "unused")
    assert list(datasets) == ["musique", "b/musique", "a/musique"]
    assert [len(exs) for exs in datasets.values()] == [1, 2, 1]
    assert datasets["b/musique"] == load_dataset(str(b))
    # The same names on every run (resumed progress is keyed by them).
    assert list(cli_datasets(args, "unused")) == list(datasets)


def test_a_file_given_twice_from_the_same_folder_is_numbered(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _copy_sample(tmp_path / "musique.json", 1)
    args = build_parser().parse_args(["eval", "--data", "musique.json,musique.json"])
    assert list(cli_datasets(args, "unused")) == ["musique", "musique#2"]


# --- eval progress (resume after a crash) ---------------------------------------------------------
