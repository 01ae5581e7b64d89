"""Multi-document QA sets as lists of reusable chunks.

Reads the CacheBlend format, a JSON list (or JSONL) of rows

    {"ctxs": [{"title": str, "text": str}, ...], "question": str, "answers": [...]}

where `answers` is `list[str]` (MuSiQue) or `list[list[str]]` (2WikiMQA `wikimqa_s_clean.json`).
Each ctx becomes one document, i.e. one independently encodable KV chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class QAExample:
    id: str  # "<file stem>-<row index in the file>", stable under `limit`
    documents: list[str]  # one reusable chunk each, in dataset order
    question: str
    answers: list[str]  # gold answers, flattened; score against any of them


def format_document(title: str, text: str) -> str:
    """The chunk text of one ctx: `title + "\\n" + text`, or just `text` when the title is empty.

    NOTE: the text is kept byte-for-byte (no strip): chunk KV caches are keyed on exact text.
    """
    return f"{title}\n{text}" if title else text


def load_qa(path: str | Path, limit: int | None = None) -> list[QAExample]:
    """Load the first `limit` rows (all when None) of a CacheBlend-format `.json` or `.jsonl` file.

    Raises ValueError naming the file for an unknown extension, invalid JSON, or a row that is
    not a CacheBlend QA row (e.g. a LongBench `{context, input}` row).
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    rows = _read_rows(path, limit)
    return [_parse_row(row, i, path) for i, row in enumerate(rows)]


def bundled_sample_path() -> Path:
    """The demo sample shipped with the package: the first 8 rows of CacheBlend's musique_s.json."""
    return Path(__file__).resolve().parent.parent / "data" / "musique_sample.json"


def shared_data_dir() -> Path | None:
    """`<repo root>/../shared/data` when it exists (a source checkout next to the shared data), else None."""
    repo_root = Path(__file__).resolve().parents[2]
    candidate = repo_root.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


def _read_rows(path: Path, limit: int | None) -> list[Any]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, limit)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from e
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of QA rows, got {type(data).__name__}")
        return data if limit is None else data[:limit]
    raise ValueError(f"{path}: unknown QA file format {path.suffix!r} (expected .json or .jsonl)")


def _read_jsonl(path: Path, limit: int | None) -> list[Any]:
    rows: list[Any] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break  # no need to read (or validate) the rest of a large file
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no}: invalid JSON: {e}") from e
    return rows


def _parse_row(row: Any, index: int, path: Path) -> QAExample:
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: row {index}: {why} (expected CacheBlend {{ctxs, question, answers}})")

    if not isinstance(row, dict):
        raise bad(f"row is a {type(row).__name__}, not an object")
    missing = [k for k in ("ctxs", "question", "answers") if k not in row]
    if missing:
        raise bad(f"missing keys {missing}; has {sorted(row)}")

    ctxs, question = row["ctxs"], row["question"]
    if not isinstance(ctxs, list) or not ctxs:
        raise bad("'ctxs' must be a non-empty list")
    documents = []
    for j, ctx in enumerate(ctxs):
        if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
            raise bad(f"ctxs[{j}] must be an object with a string 'text'")
        title = ctx.get("title") or ""  # CacheBlend's samsum ctxs carry no title at all
        if not isinstance(title, str):
            raise bad(f"ctxs[{j}].title must be a string")
        documents.append(format_document(title, ctx["text"]))
    if not isinstance(question, str) or not question.strip():
        raise bad("'question' must be a non-empty string")

    answers = _flatten_answers(row["answers"])
    if answers is None:
        raise bad("'answers' must be a non-empty list of strings or of lists of strings")
    return QAExample(id=f"{path.stem}-{index}", documents=documents, question=question, answers=answers)


def _flatten_answers(raw: Any) -> list[str] | None:
    """MuSiQue gives `[str]`, 2WikiMQA `[[str]]` (alias lists); None when neither."""
    if not isinstance(raw, list):
        return None
    flat: list[str] = []
    for a in raw:
        items = a if isinstance(a, list) else [a]
        if not all(isinstance(x, str) for x in items):
            return None
        flat.extend(items)
    return flat or None
