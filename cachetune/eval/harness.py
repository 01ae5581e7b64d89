"""`cachetune eval`: every method on the same examples, quality and TTFT measured in one run.

Per example, untimed one-off work comes first: each document is cached as a chunk, offline rankings
the methods read are computed, and the prefix cache is seeded with the system prompt followed by
each document (what a vLLM server holds after serving each document once as a prompt's first
document). Then every method serves the request, interleaved: full recompute first, since its
greedy answer is the reference every other method is teacher-forced on (KL(full || method), top-1
agreement), then the rest, each decoding its own greedy answer for answer match and F1 / ROUGE-L.
A method's prefill is timed on its own (time to first token) and teacher-forced; its answer is
generated from that same prefill by the engine's step loop (Engine.generate with `prefill`), so the
answer is exactly the argmax of the logits teacher forcing sees. Extra timing passes (`repeats`) rotate the method order so no method always runs first.

Each finished example is appended to a JSONL progress file, so an interrupted run resumes where it
stopped (the run's settings are checked first) and `limit` can grow a run step by step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from cachetune.config import EngineConfig
from cachetune.engine.calibration import device_identity
from cachetune.engine.engine import Engine
from cachetune.engine.prompt import DEFAULT_SYSTEM, DOCUMENT_SEPARATOR, QUESTION_LABEL
from cachetune.eval.datasets import QAExample
from cachetune.eval.metrics import kl_to_reference, score_answer, top1_agreement
from cachetune.kvlink.links import LinkTokens
from cachetune.methods import (Prefill, PromptLayout, config_settings, is_method, method_names,
                               method_settings)
from cachetune.methods.full_recompute import FULL_RECOMPUTE, PREFIX
from cachetune.runtime.decode import SamplingConfig

TASK_SYSTEM = {
    "qa": DEFAULT_SYSTEM,
    "summarization": "Follow the instruction after the given texts. Only give the summary.",
}
TASK_MAX_NEW_TOKENS = {"qa": 32, "summarization": 128}


@dataclass
class EvalConfig:
    methods: list[str] = field(default_factory=method_names)
    ratio: float = EngineConfig.ratio
    ratios: tuple[float, ...] = ()      # several budgets: each ratio-using method once per r, "name@r"
    sweep_examples: int | None = None   # with ratios: the ratios other than `ratio` on each set's first N only
    max_new_tokens: int | None = None  # None: per task (TASK_MAX_NEW_TOKENS)
    repeats: int = 0                    # extra timing-only passes per example, method order rotated
    warmup: bool = True                 # one untimed request per method before the first measurement
    system: str | None = None           # None: per task (TASK_SYSTEM)
    gold_nll: bool = False              # also the NLL of the gold answer per method, and with no context
    # Methods run again on a resumed example beside the ones a run adds to it, so that both are timed in
    # one pass (the record of a re-run method is replaced; its KL and answers are deterministic).
    retime: tuple[str, ...] = ()
    # Methods run again on a resumed example whose record of them was made with other settings (their
    # default changed): the record is replaced, so a rerun interrupted and resumed does not repeat itself.
    rerun: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [m for m in (*self.methods, *self.retime, *self.rerun) if not is_method(m.partition("@")[0])]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(method_names())}, cachetune:<ranking>")
        for m in self.methods:
            if "@" in m:
                _at_ratio(m)  # a clear error for a bad "method@r" now
        for r in (self.ratio, *self.ratios):
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"ratio must be in [0, 1], got {r}")
        self.ratios = tuple(self.ratios)
        if self.sweep_examples is not None:
            if self.sweep_examples < 0:
                raise ValueError(f"sweep_examples must be >= 0, got {self.sweep_examples}")
            if self.ratio not in self.ratios:
                raise ValueError(f"sweep_examples needs the ratio {self.ratio:g} among the ratios {self.ratios}: "
                                 "it is the one every example runs")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        # Every fidelity metric and every speedup is relative to full recompute, which runs first.
        self.methods = [FULL_RECOMPUTE] + [m for m in dict.fromkeys(self.methods) if m != FULL_RECOMPUTE]

    def variants(self) -> list["Variant"]:
        """One per method: "method@r" at r, a method with a budget once per ratio of `ratios` (when
        set), the rest at `ratio`."""
        out = []
        for m in self.methods:
            if "@" in m:
                base, ratio = _at_ratio(m)
                out.append(Variant(m, base, ratio))
            elif self.ratios and uses_ratio(m):
                out += [Variant(f"{m}@{r:g}", m, r) for r in self.ratios]
            else:
                out.append(Variant(m, m, self.ratio))
        return out

    def variants_for(self, index: int, variants: list["Variant"]) -> list["Variant"]:
        """What the `index`-th example of a set runs: past `sweep_examples`, only `ratio` of a sweep."""
        if self.sweep_examples is None or index < self.sweep_examples:
            return variants
        return [v for v in variants if not uses_ratio(v.method) or v.ratio == self.ratio]

    def run_key(self, engine: Engine) -> dict:
        """What must match for records of two runs to be merged (resume)."""
        key = {"model": engine.name, "dtype": engine.config.dtype, "ratio": self.ratio,
               "max_new_tokens": self.max_new_tokens, "system": self.system}
        if engine.config.ranking != "lf":  # plain "cachetune" means the configured ranking
            key["ranking"] = engine.config.ranking
        # ... and its selection, when a method reads it from the config (a name may set it) and it is
        # not the default. Files written under earlier defaults name the old ones, so they still resume.
        reads = set().union(*(config_settings(m.partition("@")[0]) for m in self.methods))
        for name in ("allocation", "signal"):
            if name in reads and getattr(engine.config, name) != getattr(EngineConfig, name):
                key[name] = getattr(engine.config, name)
        # Deep focus by default: named whatever the methods, so that a file written before the setting
        # (every method ran without it) resumes only with --deep-within 0, and one run's files all match.
        if engine.config.deep_within:
            key["deep_within"] = engine.config.deep_within
        if engine.adapter.device.type != "cpu":  # GPU timings must not merge with CPU ones
            key["device"] = engine.adapter.device.type
        if self.gold_nll:
            key["gold_nll"] = True
        # Plain "c2kv" / "kvlink" mean the configured trained tokens: name them by their weights.
        if "c2kv" in self.methods:
            key["c2kv_extractor"] = engine.extractors.get(engine.config.c2kv_extractor).variant
        if "kvlink" in self.methods:
            key["kvlink_links"] = engine.extractors.get(engine.config.kvlink_links, LinkTokens).variant
        return key


def _at_ratio(label: str) -> tuple[str, float]:
    """"method@r" -> (method, r): one method at its own budget beside the run's ratio."""
    base, _, text = label.partition("@")
    try:
        ratio = float(text)
    except ValueError:
        raise ValueError(f"{label!r}: expected method@ratio, e.g. cachetune@0.25") from None
    if not 0.0 <= ratio <= 1.0 or not uses_ratio(base):
        raise ValueError(f"{label!r}: the ratio must be in [0, 1], and {base!r} must have a recompute budget")
    return base, ratio


def uses_ratio(method: str) -> bool:
    """Whether the method has a recompute budget (runs once per ratio of a --ratios sweep)."""
    return "ratio" in {f.name for f in dataclasses.fields(method_settings(method))}


@dataclass(frozen=True)
class Variant:
    """One way to serve a request: a method spec ("cachetune:lf:0.3", ...) at a ratio, under a label."""

    label: str
    method: str
    ratio: float


@dataclass
class _Request:
    engine: Engine
    example: QAExample
    chunk_ids: list[str]
    system: str
    label: str
    sampling: SamplingConfig
    preamble: torch.Tensor | None = None  # uncached text before the chunks (robustness analysis)

    def prompt(self) -> PromptLayout:
        """Template and system prompt, the preamble, the chunks, then the question after `label`."""
        before, after = self.engine.template.segments(self.system, self.example.question, self.label)
        if self.preamble is not None and self.preamble.numel():
            before = torch.cat([before, self.preamble])
        return self.engine.prompt_from(before, self.chunk_ids, after)

    def start(self, variant: Variant, extra: int) -> "Started":
        """Everything a request pays before its first token (prompt assembly, selection, loading,
        prefill, the argmax), timed. `extra` rows are for decoding."""
        start = time.perf_counter()
        prompt = self.prompt()
        result = self.engine.prefill(prompt, variant.method, variant.ratio, capacity=prompt.total + extra)
        int(torch.argmax(result.logits))  # reading the id waits for a GPU's queued kernels
        return Started(prompt, result, (time.perf_counter() - start) * 1000)

    def decode(self, variant: Variant, started: "Started") -> list[int]:
        """The greedy answer from a started request's prefill, generated by the engine's step loop
        (QA stops once its first line is done). The prefill's cache keeps the answer's rows."""
        stop = self._first_line_done if self.example.task == "qa" else None
        return self.engine.generate(method=variant.method, ratio=variant.ratio, sampling=self.sampling, stop=stop,
                                    prompt=started.prompt, prefill=started.prefill).token_ids

    def _first_line_done(self, ids: list[int]) -> bool:
        # QA is scored on the first non-empty line only: stop decoding once that line has ended.
        return "\n" in self.engine.tokenizer.decode(ids, skip_special_tokens=True).lstrip()


class Started(NamedTuple):
    """A request prefilled for eval: its prompt, prefill and time to first token."""

    prompt: PromptLayout
    prefill: Prefill
    ttft_ms: float


def prepare(engine: Engine, example: QAExample, variants: list[Variant], system: str | None = None,
            max_new_tokens: int | None = None) -> _Request:
    """The untimed one-off work for an example: chunks cached, offline rankings, prefix cache seeded."""
    system = system if system is not None else TASK_SYSTEM[example.task]
    label = "" if example.verbatim else QUESTION_LABEL
    ids = [engine.cache_document(doc) for doc in example.documents]
    budget = max_new_tokens or TASK_MAX_NEW_TOKENS[example.task]
    req = _Request(engine, example, ids, system, label, SamplingConfig(max_new_tokens=budget))
    prompt = req.prompt()
    for variant in variants:
        engine.prepare(prompt, engine.method(variant.method, variant.ratio))
    if any(v.method == PREFIX for v in variants):
        before = prompt.segments[0].token_ids
        for cid in ids:  # what a vLLM server holds after serving each document as a prompt's first
            engine.cache_prefix(torch.cat([before, engine.chunk(cid).token_ids]))
    return req


def _teacher_forced_logits(engine: Engine, result, answer: list[int]) -> torch.Tensor:
    """Next-token logits at the prompt end and after each answer token: [len(answer) + 1, vocab]."""
    first = result.logits.unsqueeze(0)
    if not answer:
        return first
    rest = result.extend(engine.adapter, answer)
    result.cache.truncate(result.prompt_rows)
    return torch.cat([first, rest])


def gold_answer_ids(engine: Engine, example: QAExample) -> list[int]:
    """The first gold answer's tokens followed by the end-of-turn token (what a model should emit)."""
    return engine.tokenize(example.answers[0]).tolist() + [engine.eos_id()]


def _gold_nll(engine: Engine, result, gold: list[int]) -> float:
    """Mean NLL per token of `gold` teacher-forced after the prompt (the cache is left at the prompt)."""
    logits = _teacher_forced_logits(engine, result, gold[:-1])
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(gold, device=logits.device)))


def settings_record(engine: Engine, variant: Variant) -> dict:
    """The settings `variant`'s method runs with on `engine`, as a progress record stores them (what
    EvalConfig.rerun compares)."""
    settings = engine.method(variant.method, variant.ratio).settings
    return json.loads(json.dumps(asdict(settings), default=str)) if dataclasses.is_dataclass(settings) else {}


def run_example(engine: Engine, req: _Request, variants: list[Variant], dataset: str, repeats: int = 0,
                gold_nll: bool = False) -> dict:
    """Serve one prepared request with every variant (the first must be full recompute: the reference).

    With `gold_nll`, every method also records the NLL of the gold answer, and the record the NLL
    with no documents at all (what the "gap closed" between no context and full recompute is against)."""
    if variants[0].method != FULL_RECOMPUTE:
        raise ValueError("the first variant must be full recompute (every metric is relative to it)")
    example = req.example
    chunk_tokens = sum(engine.chunk(c).num_tokens for c in req.chunk_ids)
    record: dict = {"id": example.id, "dataset": dataset, "task": example.task, "methods": {},
                    "chunk_tokens": chunk_tokens, "kv_bytes_per_row": engine.kv_bytes_per_row}
    gold = gold_answer_ids(engine, example) if gold_nll else None
    if gold is not None:
        bare = replace(req, chunk_ids=[])
        record["no_context_nll"] = _gold_nll(engine, engine.prefill(bare.prompt(), FULL_RECOMPUTE), gold)
    ref_answer: list[int] = []
    ref_logits = None
    # Timings from one progress file may come from several machines (resumed runs): each says where.
    device = device_identity(engine.adapter.device)
    for variant in variants:
        started = req.start(variant, req.sampling.max_new_tokens + 1)
        result, ttft = started.prefill, started.ttft_ms
        if variant.method == FULL_RECOMPUTE:
            ref_answer = answer = req.decode(variant, started)
            result.cache.truncate(result.prompt_rows)
            ref_logits = _teacher_forced_logits(engine, result, ref_answer)
            record["prompt_tokens"] = result.prompt_tokens
            kl, top1 = 0.0, [1.0] * ref_logits.shape[0]
        else:
            logits = _teacher_forced_logits(engine, result, ref_answer)
            kl = float(kl_to_reference(ref_logits, logits).mean())
            top1 = top1_agreement(ref_logits, logits).float().tolist()
        nll = _gold_nll(engine, result, gold) if gold is not None else None
        if variant.method != FULL_RECOMPUTE:
            answer = req.decode(variant, started)
        text = engine.tokenizer.decode(answer, skip_special_tokens=True)
        record["methods"][variant.label] = {
            "ttft_ms": [ttft],
            "kl": kl,
            "top1": top1,
            "match": float(answer == ref_answer),
            "score": score_answer(example.task, text, example.answers),
            "recomputed_share": result.recomputed_chunk_tokens / max(chunk_tokens, 1),
            "reused_rows": result.reused_rows,
            "prompt_rows": result.prompt_rows,
            "answer": text,
            "device": device,
            "settings": settings_record(engine, variant),
        }
        if nll is not None:
            record["methods"][variant.label]["nll"] = nll
    for r in range(repeats):
        order = variants[r + 1:] + variants[: r + 1]
        for variant in order:
            record["methods"][variant.label]["ttft_ms"].append(req.start(variant, 1).ttft_ms)
    return record


class ProgressLog:
    """Append-only JSONL of finished examples, keyed by (dataset, id) and tied to one run's settings."""

    def __init__(self, path: str | Path, key: dict):
        self.path = Path(path)
        self.key = key
        self.records: dict[tuple[str, str], dict] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            for line_no, line in enumerate(data.split(b"\n"), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
                    # A line cut short by an interrupted write: drop it, the example will run again.
                    continue
                if row.get("key") != key:
                    raise ValueError(f"{self.path}: line {line_no} was written by another run {row.get('key')} "
                                     f"(this run: {key}); use another --json path or delete the file")
                self.records[(row["record"]["dataset"], row["record"]["id"])] = row["record"]
            self._end_last_line(data)

    def _end_last_line(self, data: bytes) -> None:
        """Make the next append start on a line of its own (`data`: the file as read).

        An unterminated last line is what a crash mid-write leaves: if it does not parse, the file is
        cut back to the end of the line before it (appending to it would garble the next record too);
        if it does parse, the record is complete and kept: only its newline is added."""
        end = data.rfind(b"\n") + 1  # end of the last complete line; 0 when there is none
        tail = data[end:]
        if not tail.strip():
            return
        try:
            json.loads(tail)
        except ValueError:
            with self.path.open("r+b") as f:
                f.truncate(end)
        else:
            with self.path.open("ab") as f:
                f.write(b"\n")

    def done(self, dataset: str, example_id: str) -> dict | None:
        return self.records.get((dataset, example_id))

    def add(self, record: dict) -> None:
        self.records[(record["dataset"], record["id"])] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": self.key, "record": record}) + "\n")
            f.flush()


@dataclass(frozen=True)
class Setting:
    """How a request is assembled from an example (the paper's Figure 1c varies this)."""

    name: str = "default"
    shuffle: bool = False       # chunks in a random order (seeded by the example id)
    preamble_tokens: int = 0    # uncached unrelated text (another example's documents) before the chunks
    other_question: bool = False  # ask another example's question (same task) over these documents

    def apply(self, req: _Request, filler: QAExample) -> None:
        if self.other_question:
            # Gold answers go with the question; over these documents only fidelity is meaningful.
            req.example = replace(req.example, question=filler.question, answers=filler.answers)
        if self.shuffle:
            g = torch.Generator().manual_seed(sum(map(ord, req.example.id)))
            req.chunk_ids = [req.chunk_ids[i] for i in torch.randperm(len(req.chunk_ids), generator=g)]
        if self.preamble_tokens:
            text = DOCUMENT_SEPARATOR.join(filler.documents)
            req.preamble = req.engine.tokenize(text)[: self.preamble_tokens]


def run_eval(engine: Engine, datasets: dict[str, list[QAExample]], cfg: EvalConfig,
             progress_path: str | Path | None = None, progress: bool = True,
             variants: list[Variant] | None = None, settings: tuple[Setting, ...] = (Setting(),)) -> list[dict]:
    """Run every dataset's examples (resuming from `progress_path`); returns all records in order.

    `variants` default to cfg's methods at cfg.ratio. Each non-default setting is recorded as dataset
    "<name>/<setting>". A resumed example keeps its measurements; variants it lacks are run and added."""
    variants = variants or cfg.variants()
    log = ProgressLog(progress_path, cfg.run_key(engine)) if progress_path else None
    todo = [(name, exs, i, setting) for name, exs in datasets.items() for i in range(len(exs)) for setting in settings]
    records: list[dict] = []
    warm = not cfg.warmup
    bar = tqdm(todo, desc="eval", disable=not progress, unit="request")
    for name, exs, i, setting in bar:
        ex = exs[i]
        label = name if setting.name == "default" else f"{name}/{setting.name}"
        bar.set_postfix_str(f"{label} {ex.id}")
        old = log.done(label, ex.id) if log else None
        todo_variants = cfg.variants_for(i, variants)
        if old is not None:
            # Resume: run only the variants the record lacks, against a fresh reference (full
            # recompute is deterministic, so its answer and logits are the ones the record used).
            added = [v for v in todo_variants if v.label not in old["methods"]]
            kept = [v for v in todo_variants[1:] if v.label in old["methods"]]
            stale = [v for v in kept if v.method in cfg.rerun
                     and old["methods"][v.label].get("settings") != settings_record(engine, v)]
            if not added and not stale:
                records.append(old)
                continue
            again = [v for v in kept if v not in stale and added and v.method in cfg.retime]
            todo_variants = [variants[0], *stale, *again, *added]
        req = prepare(engine, ex, todo_variants, cfg.system, cfg.max_new_tokens)
        setting.apply(req, exs[(i + 1) % len(exs)])
        if not warm:
            for variant in todo_variants:  # untimed: first-call allocations and thread start-up
                req.start(variant, 1)
            warm = True
        record = run_example(engine, req, todo_variants, label, cfg.repeats, cfg.gold_nll)
        if old is not None:
            # Speedups of the added (and re-timed) variants are against the full recompute timed in this pass.
            reference = record["methods"][variants[0].label]["ttft_ms"]
            ran = {k: {**v, "full_ttft_ms": reference} for k, v in record["methods"].items()
                   if k != variants[0].label}
            record = {**old, "methods": {**old["methods"], **ran}}
        if log:
            log.add(record)
        records.append(record)
    return records


def config_dict(cfg: EvalConfig) -> dict:
    return asdict(cfg)
