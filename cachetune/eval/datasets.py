"""Evaluation sets as lists of reusable chunks followed by an uncached question.

Every example is `documents` (one independently encodable KV chunk each, in prompt order), then
`question` (the uncached text that follows them in the user message), scored against `answers`.
One loader per file format; `DATASETS` names the files of `shared/data` (see its README.md):

    CacheBlend  [{"ctxs": [{"title", "text"}], "question", "answers"}]       musique, 2wikimqa
    IRCoT       {"question_text", "answers_objects": [{"spans"}], "contexts"}  hotpotqa
    LongBench   {"context": "Passage 1:\\n...", "input", "answers", "dataset"}  multi_news
    SAMSum      {"context": dialogue, "response": summary}                    samsum (+ validation demos)
    MiniLongBench {"0": {"origin_prompt", "gold"}, ...}                       lb_* (full LongBench prompts)

Document text is kept byte-for-byte: chunk KV caches are keyed on exact text. The only edit is
splitting a LongBench context at its `Passage N:\\n` headers (or its few-shot `Dialogue: ` blocks),
so `"".join(f"Passage {i}:\\n" + doc ...)` rebuilds the context exactly.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TASKS = ("qa", "summarization")
# Where the registered datasets live when not beside the checkout (e.g. a copy on another machine).
DATA_DIR_ENV = "CACHETUNE_DATA_DIR"

# LongBench's closing instruction for multi_news; the documents come first, so it is the question.
MULTI_NEWS_INSTRUCTION = "Now, write a one-page summary of all the news."
SAMSUM_INSTRUCTION = "Summarize the dialogue below into a few short sentences, like the examples above."
# 16 demos of ~160 tokens each (chars / 4) make ~2.7K-token prompts; drawn from a fixed pool of 128
# so the same demo chunks recur across requests, as a deployed few-shot prompt library would.
SAMSUM_DEMOS = 16
SAMSUM_POOL = 128


@dataclass(frozen=True)
class QAExample:
    id: str  # "<dataset name or file stem>-<row index in the file>", stable under `limit`
    documents: list[str]  # one reusable chunk each, in dataset order
    question: str  # uncached text after the documents (for summarization: the instruction)
    answers: list[str]  # gold answers / reference summaries, flattened; score against any of them
    task: str = "qa"  # "qa" (token F1) or "summarization" (ROUGE-L)
    # True when `question` is the complete text after the documents (LongBench prompts, summary
    # instructions) and goes into the prompt as is; False for a bare question ("Question: " added).
    verbatim: bool = False
    supporting: tuple[int, ...] = ()  # indices of the documents labelled as supporting (IRCoT rows)


Loader = Callable[..., list[QAExample]]  # (path, limit=None, name=None) -> examples


@dataclass(frozen=True)
class DatasetSpec:
    path: str  # relative to the shared data directory
    task: str
    loader: Loader


def format_document(title: str, text: str) -> str:
    """The chunk text of one ctx: `title + "\\n" + text`, or just `text` when the title is empty.

    NOTE: the text is kept byte-for-byte (no strip): chunk KV caches are keyed on exact text.
    """
    return f"{title}\n{text}" if title else text


def format_samsum_demo(dialogue: str, summary: str) -> str:
    """One few-shot chunk, laid out as in LongBench's samsum context (each block ends with "\\n")."""
    return f"Dialogue: {dialogue}\nSummary: {summary}\n"


def split_passages(context: str) -> list[str]:
    """The documents of a LongBench context: the text between `Passage N:\\n` headers, empty pieces dropped.

    Headers only count at the start of a line, so a passage quoting "Passage 2:" mid-line stays whole.
    """
    return [p for p in re.split(r"(?m)^Passage \d+:\n", context) if p.strip()]


def split_demos(context: str) -> list[str]:
    """The few-shot blocks of a LongBench samsum context, each `Dialogue: ...\\nSummary: ...\\n`."""
    return [p for p in re.split(r"(?m)^(?=Dialogue: )", context) if p.strip()]


# A sentence ends at . ! or ? followed by white space, and a paragraph at a blank line. A single line
# break does not end one: a title line stays with the sentence under it.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n\s*")


def sentences(text: str) -> list[str]:
    """`text` cut after each sentence end (and blank line), every piece keeping the white space that
    follows it, so "".join(sentences(text)) == text."""
    pieces, at = [], 0
    for end in _SENTENCE_END.finditer(text):
        if end.end() > at and end.start() > at:
            pieces.append(text[at:end.end()])
            at = end.end()
    if at < len(text):
        pieces.append(text[at:])
    return pieces


def rechunk(example: QAExample, tokens: int, count: Callable[[str], int]) -> QAExample:
    """`example` with its documents cut again into chunks of about `tokens` tokens, as a RAG pipeline
    chunks a corpus: the documents' text in order, a blank line between two, packed sentence by
    sentence (`count` gives a text's tokens) into a chunk until the next sentence would pass `tokens`.
    A sentence longer than `tokens` is a chunk of its own; no chunk ends mid-sentence. Every chunk is
    then a document of its own (cached alone); the labelled supporting documents no longer apply."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    chunks, current, size = [], "", 0
    for piece in sentences("\n\n".join(d.strip() for d in example.documents if d.strip())):
        n = count(piece)
        if current and size + n > tokens:
            chunks.append(current.rstrip())
            current, size = "", 0
        current, size = current + piece, size + n
    if current.strip():
        chunks.append(current.rstrip())
    return dataclasses.replace(example, id=f"{example.id}@{tokens}t", documents=chunks, supporting=())


# --- loaders, one per file format ------------------------------------------------------------


def load_qa(path: str | Path, limit: int | None = None, name: str | None = None) -> list[QAExample]:
    """Load the first `limit` rows (all when None) of a CacheBlend-format `.json` or `.jsonl` file.

    Raises ValueError naming the file for an unknown extension, invalid JSON, or a row that is
    not a CacheBlend QA row (e.g. a LongBench `{context, input}` row).
    """
    path, prefix = _start(path, limit, name)
    return [_parse_cacheblend(row, i, path, prefix) for i, row in enumerate(_read_rows(path, limit))]


def load_ircot(path: str | Path, limit: int | None = None, name: str | None = None) -> list[QAExample]:
    """IRCoT HotpotQA rows: one document per context (`title\\nparagraph_text`), answers from the spans.

    NOTE: `hotpotqa/dev_subsampled.jsonl` is HotpotQA dev and the README reserves it for training
    extractors; it is loadable for smoke tests, not for headline results.
    """
    path, prefix = _start(path, limit, name)
    examples = []
    for i, row in enumerate(_read_jsonl(path, limit)):
        bad = _row_error(path, i, "IRCoT {question_text, answers_objects, contexts}")
        _require(row, ("question_text", "answers_objects", "contexts"), bad)
        documents = _documents(row, "contexts", "paragraph_text", bad)
        answers = _ircot_answers(row["answers_objects"])
        if not answers:
            raise bad("'answers_objects' must be a list of objects whose 'spans' is a non-empty string "
                      "or a list of them")
        question = _nonempty_str(row, "question_text", bad)
        supporting = tuple(j for j, c in enumerate(row["contexts"]) if c.get("is_supporting") is True)
        examples.append(QAExample(f"{prefix}-{i}", documents, question, answers, supporting=supporting))
    return examples


def load_longbench(path: str | Path, limit: int | None = None, name: str | None = None) -> list[QAExample]:
    """LongBench `.jsonl` rows of the multi-document sets (multi_news, samsum, hotpotqa, 2wikimqa, musique).

    multi_news: the passages, then MULTI_NEWS_INSTRUCTION. samsum: the few-shot blocks, then `input`.
    QA sets: the passages, then `input` (the question).
    """
    path, prefix = _start(path, limit, name)
    examples = []
    for i, row in enumerate(_read_jsonl(path, limit)):
        bad = _row_error(path, i, "LongBench {context, input, answers, dataset}")
        _require(row, ("context", "input", "answers"), bad)
        context = _nonempty_str(row, "context", bad)
        dataset = row.get("dataset")
        if dataset == "samsum":
            first, split, question, task = "Dialogue: ", split_demos, row["input"], "summarization"
        elif dataset == "multi_news":
            first, split, question, task = "Passage 1:\n", split_passages, MULTI_NEWS_INSTRUCTION, "summarization"
        else:
            first, split, question, task = "Passage 1:\n", split_passages, row["input"], "qa"
        if not context.startswith(first):
            raise bad(f"'context' must start with {first!r}")  # anything before it would be lost
        documents = split(context)
        if not isinstance(question, str) or not question.strip():
            raise bad("'input' must be a non-empty string")
        answers = _flatten_answers(row["answers"])
        if answers is None:
            raise bad("'answers' must be a non-empty list of strings")
        examples.append(QAExample(f"{prefix}-{i}", documents, question, answers, task, verbatim=True))
    return examples


def load_samsum(
    path: str | Path,
    limit: int | None = None,
    name: str | None = None,
    demo_path: str | Path | None = None,
    demos: int = SAMSUM_DEMOS,
    pool: int = SAMSUM_POOL,
) -> list[QAExample]:
    """SAMSum as few-shot summarization: `demos` reusable demo chunks, then the query dialogue.

    Queries are the rows of `path` (the test split); demos come from the first `pool` rows of
    `demo_path` (default: `validation.jsonl` next to `path`). Row i draws its demos with
    `random.Random(i)`, so an example's prompt does not depend on `limit`.
    """
    path, prefix = _start(path, limit, name)
    demo_path = Path(demo_path) if demo_path is not None else path.with_name("validation.jsonl")
    if not demo_path.is_file():
        raise FileNotFoundError(f"{path}: SAMSum demos expected in {demo_path}")
    chunks = [format_samsum_demo(*_samsum_row(r, j, demo_path)) for j, r in enumerate(_read_jsonl(demo_path, pool))]
    if not 0 < demos <= len(chunks):
        raise ValueError(f"{demo_path}: need {demos} demos, the pool has {len(chunks)}")
    examples = []
    for i, row in enumerate(_read_jsonl(path, limit)):
        dialogue, summary = _samsum_row(row, i, path)
        picked = random.Random(i).sample(chunks, demos)
        question = f"{SAMSUM_INSTRUCTION}\n\nDialogue: {dialogue}\nSummary:"
        examples.append(QAExample(f"{prefix}-{i}", picked, question, [summary], "summarization", verbatim=True))
    return examples


@dataclass(frozen=True)
class _PromptLayout:
    """Where a full LongBench prompt keeps its documents: `header ... first ... <docs> tail ...`."""

    header: str  # the instruction the prompt starts with
    first: str  # where the documents start
    tail: str  # "\n\n" + the text after the documents; its last occurrence ends them
    task: str
    split: Callable[[str], list[str]]


_PROMPT_LAYOUTS = (
    _PromptLayout("Answer the question based on the given passages.", "Passage 1:\n",
                  "\n\nAnswer the question based on the given passages.", "qa", split_passages),
    _PromptLayout("You are given several news passages.", "Passage 1:\n",
                  "\n\nNow, write a one-page summary", "summarization", split_passages),
    _PromptLayout("Summarize the dialogue", "Dialogue: ", "\n\nDialogue: ", "summarization", split_demos),
)


def load_longbench_prompts(path: str | Path, limit: int | None = None, name: str | None = None) -> list[QAExample]:
    """MiniLongBench files: full LongBench prompts split back into documents and the text after them.

    The instruction before the first document is dropped (the engine adds its own system prompt);
    `question` is everything after the last document, e.g. "Answer the question ...\\n\\nQuestion: q\\nAnswer:".
    `gold` is a Python-repr string of the answer list (or already a list).
    """
    path, prefix = _start(path, limit, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of MiniLongBench items, got {type(data).__name__}")
    examples = []
    for key, item in list(data.items())[:limit]:
        bad = _row_error(path, key, "MiniLongBench {origin_prompt, gold}")
        _require(item, ("origin_prompt", "gold"), bad)
        prompt = _nonempty_str(item, "origin_prompt", bad)
        layout = next((lay for lay in _PROMPT_LAYOUTS if prompt.startswith(lay.header)), None)
        start, end = (prompt.find(layout.first), prompt.rfind(layout.tail)) if layout else (-1, -1)
        if layout is None or not 0 <= start < end:
            raise bad("'origin_prompt' is not a LongBench passages / news / samsum prompt")
        documents = layout.split(prompt[start:end])
        answers = _flatten_answers(_literal_gold(item["gold"]))
        if answers is None:
            raise bad("'gold' must be a list of strings, or its Python repr")
        examples.append(
            QAExample(f"{prefix}-{key}", documents, prompt[end + 2 :], answers, layout.task, verbatim=True)
        )
    return examples


# --- the held-out HotpotQA split -----------------------------------------------------------------

# `hotpotqa/dev_subsampled.jsonl` is the only set training may read: a fixed permutation holds out
# HELDOUT of its rows, which no training run ever reads (cachetune.train.data) and evaluation may.
HELDOUT = 100      # held-out rows (of 500)
SPLIT_SEED = 0


@dataclass(frozen=True)
class Split:
    train: list[QAExample]
    heldout: list[QAExample]


def split_examples(examples: list[QAExample], heldout: int = HELDOUT, seed: int = SPLIT_SEED) -> Split:
    """Fixed held-out split: a seeded permutation, the first `heldout` rows held out (file order kept)."""
    if not 0 < heldout < len(examples):
        raise ValueError(f"heldout must be in (0, {len(examples)}), got {heldout}")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    return Split([examples[i] for i in sorted(order[heldout:])], [examples[i] for i in sorted(order[:heldout])])


# The only set the data README allows training on; training reads its rows outside the held-out split.
TRAIN_SET = "hotpotqa"


def load_split(heldout: int = HELDOUT, seed: int = SPLIT_SEED) -> Split:
    """The training set split into the rows training reads and the held-out rows it never reads."""
    return split_examples(load_dataset(TRAIN_SET), heldout, seed)


def load_heldout(path: str | Path, limit: int | None = None, name: str | None = None) -> list[QAExample]:
    """The first `limit` held-out rows of the HotpotQA file (short chunks: 10 paragraphs of ~120 tokens)."""
    rows = split_examples(load_ircot(path, None, name)).heldout
    return rows[:limit] if limit is not None else rows


def load_train(path: str | Path, limit: int | None = None, name: str | None = None) -> list[QAExample]:
    """The first `limit` HotpotQA rows outside the held-out split: what tuning a setting may read."""
    rows = split_examples(load_ircot(path, None, name)).train
    return rows[:limit] if limit is not None else rows


# --- the registry ------------------------------------------------------------------------------

DATASETS: dict[str, DatasetSpec] = {
    "musique": DatasetSpec("musique/musique_s.json", "qa", load_qa),
    "2wikimqa": DatasetSpec("2wikimqa/wikimqa_s_clean.json", "qa", load_qa),
    "hotpotqa": DatasetSpec("hotpotqa/dev_subsampled.jsonl", "qa", load_ircot),  # training only
    "hotpotqa_heldout": DatasetSpec("hotpotqa/dev_subsampled.jsonl", "qa", load_heldout),
    "hotpotqa_train": DatasetSpec("hotpotqa/dev_subsampled.jsonl", "qa", load_train),  # tuning only
    "multi_news": DatasetSpec("multi_news/multi_news.jsonl", "summarization", load_longbench),
    "samsum": DatasetSpec("samsum/test.jsonl", "summarization", load_samsum),
    **{
        f"lb_{n}": DatasetSpec(f"longbench_mini/MiniLongBench_{n}.json", task, load_longbench_prompts)
        for n, task in [("hotpotqa", "qa"), ("2wikimqa", "qa"), ("musique", "qa"),
                        ("samsum", "summarization"), ("multi_news", "summarization")]
    },
}


def load_dataset(name_or_path: str, limit: int | None = None, data_dir: Path | None = None) -> list[QAExample]:
    """A registered dataset (its file under `data_dir`, default `shared_data_dir()`) or any supported file.

    Ids are `<name>-<row>` for registry names and `<file stem>-<row>` for paths. Raises
    FileNotFoundError naming the expected path, ValueError for an unrecognized or malformed file.
    """
    spec = DATASETS.get(name_or_path)
    if spec is not None:
        base = Path(data_dir) if data_dir is not None else _default_data_dir()
        path = base / spec.path
        if not path.is_file():
            raise FileNotFoundError(f"dataset {name_or_path!r}: expected {path} (pass data_dir)")
        return spec.loader(path, limit, name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"{name_or_path!r} is neither a file nor a dataset ({', '.join(DATASETS)})")
    return _detect_loader(path)(path, limit)


def bundled_sample_path() -> Path:
    """The demo sample shipped with the package: the first 8 rows of CacheBlend's musique_s.json."""
    return Path(__file__).resolve().parent.parent / "data" / "musique_sample.json"


def shared_data_dir() -> Path | None:
    """$CACHETUNE_DATA_DIR, else `<repo root>/../shared/data` (a source checkout next to the shared data),
    when it exists; else None."""
    candidate = _default_data_dir()
    return candidate if candidate.is_dir() else None


def _default_data_dir() -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else Path(__file__).resolve().parents[3] / "shared" / "data"


def _detect_loader(path: Path) -> Loader:
    """Pick the loader from the first row's keys (`.jsonl`) or the top-level JSON type (`.json`)."""
    if path.suffix == ".json":
        with path.open(encoding="utf-8") as f:
            head = f.read(64).lstrip()[:1]
        return load_longbench_prompts if head == "{" else load_qa  # CacheBlend files are a JSON list
    if path.suffix != ".jsonl":
        return load_qa  # raises the unknown-format error
    rows = _read_jsonl(path, 1)
    keys = set(rows[0]) if rows and isinstance(rows[0], dict) else set()
    for needed, loader in [({"ctxs"}, load_qa), ({"question_text", "contexts"}, load_ircot),
                           ({"context", "input"}, load_longbench), ({"context", "response"}, load_samsum)]:
        if needed <= keys:
            return loader
    if not rows:
        return load_qa
    raise ValueError(f"{path}: unrecognized row format with keys {sorted(keys)}")


# --- reading and validating rows ----------------------------------------------------------------


def _start(path: str | Path, limit: int | None, name: str | None) -> tuple[Path, str]:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = Path(path)
    return path, name or path.stem


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


def _row_error(path: Path, index: int | str, expected: str) -> Callable[[str], ValueError]:
    return lambda why: ValueError(f"{path}: row {index}: {why} (expected {expected})")


def _require(row: Any, keys: tuple[str, ...], bad: Callable[[str], ValueError]) -> None:
    if not isinstance(row, dict):
        raise bad(f"row is a {type(row).__name__}, not an object")
    missing = [k for k in keys if k not in row]
    if missing:
        raise bad(f"missing keys {missing}; has {sorted(row)}")


def _nonempty_str(row: dict, key: str, bad: Callable[[str], ValueError]) -> str:
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise bad(f"{key!r} must be a non-empty string")
    return value


def _documents(row: dict, key: str, text_key: str, bad: Callable[[str], ValueError]) -> list[str]:
    """row[key]: a non-empty list of {title?, text_key} objects -> one document text each."""
    items = row[key]
    if not isinstance(items, list) or not items:
        raise bad(f"'{key}' must be a non-empty list")
    documents = []
    for j, ctx in enumerate(items):
        if not isinstance(ctx, dict) or not isinstance(ctx.get(text_key), str):
            raise bad(f"{key}[{j}] must be an object with a string '{text_key}'")
        title = ctx.get("title") or ""  # CacheBlend's samsum ctxs carry no title at all
        if not isinstance(title, str):
            raise bad(f"{key}[{j}].title must be a string")
        documents.append(format_document(title, ctx[text_key]))
    return documents


def _parse_cacheblend(row: Any, index: int, path: Path, prefix: str) -> QAExample:
    bad = _row_error(path, index, "CacheBlend {ctxs, question, answers}")
    _require(row, ("ctxs", "question", "answers"), bad)
    documents = _documents(row, "ctxs", "text", bad)
    question = _nonempty_str(row, "question", bad)
    answers = _flatten_answers(row["answers"])
    if answers is None:
        raise bad("'answers' must be a non-empty list of strings or of lists of strings")
    return QAExample(id=f"{prefix}-{index}", documents=documents, question=question, answers=answers)


def _samsum_row(row: Any, index: int, path: Path) -> tuple[str, str]:
    bad = _row_error(path, index, "SAMSum {context, response}")
    _require(row, ("context", "response"), bad)
    return _nonempty_str(row, "context", bad), _nonempty_str(row, "response", bad)


def _ircot_answers(objects: Any) -> list[str]:
    """All spans of all answer objects; [] (an error for the caller) when any span is not a non-empty string.

    `spans` is normally a list; a bare string is one span (iterating it would give its characters)."""
    if not isinstance(objects, list) or not all(isinstance(o, dict) for o in objects):
        return []
    spans: list[Any] = []
    for o in objects:
        raw = o.get("spans")
        if raw is None:
            continue
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list):
            return []
        spans.extend(raw)
    return spans if all(isinstance(s, str) and s.strip() for s in spans) else []


def _literal_gold(gold: Any) -> Any:
    """MiniLongBench stores gold as "['a', 'b']" (a Python repr, not JSON); the shared files hold lists."""
    if not isinstance(gold, str):
        return gold
    try:
        return ast.literal_eval(gold)
    except (ValueError, SyntaxError):
        return None


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
