"""`cachetune demo` end to end on the bundled model, with three short documents (about 15 s, so it
runs with the fast tests): the report and table carry both methods side by side, and full
recompute's answer is the model's own greedy generation of the same prompt (Hugging Face
`generate`, not cachetune code)."""

from __future__ import annotations

import json

import pytest
import torch

from cachetune.cli import main
from cachetune.cli.demo import demo_example
from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine
from cachetune.eval.harness import Variant, prepare

DOCS, TOKENS = 3, 8


def test_the_demo_example_changes_only_the_documents_order():
    first, asked = demo_example()
    assert asked.documents == first.documents[::-1] and asked.question == first.question and first.answers
    _, shuffled = demo_example(order="shuffled")
    assert sorted(shuffled.documents) == sorted(first.documents) and shuffled.documents != first.documents
    row, _ = demo_example(index=0, docs=3)
    assert len(row.documents) == 3 and row.question != first.question
    _, own = demo_example(question="Who wrote it?")
    assert own.question == "Who wrote it?" and own.answers == []


def test_demo_shows_both_methods_and_full_recompute_is_the_models_greedy_answer(tmp_path, capsys):
    out = tmp_path / "demo.json"
    code = main(["demo", "--docs", str(DOCS), "--max-new-tokens", str(TOKENS), "--repeats", "0", "--threads", "2",
                 "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["full_recompute", EngineConfig.method]
    full, ours = report["methods"].values()
    ex = report["example"]
    assert ex["documents"] == DOCS and report["ratio"] == EngineConfig.ratio and report["timed_runs"] == 1
    assert full["speedup"] == 1.0 and full["kl_to_full"] == 0.0 and full["top1_agree"] == 1.0
    assert full["computed_tokens"] == ex["prompt_tokens"]  # nothing reused
    assert 0 < ours["computed_tokens"] < ex["prompt_tokens"] and 0 < ours["recomputed_share"] < 0.5
    assert ours["speedup"] > 0 and ours["kl_to_full"] >= 0 and 0 <= ours["top1_agree"] <= 1
    assert ours["answer_match_full"] == (ours["answer"] == full["answer"])
    assert 2 <= report["answer_positions"] <= TOKENS + 1
    for text in ("full recompute", "speedup", "KL to full recompute", "top-1 agreement", ex["question"],
                 full["answer"].strip(), ours["answer"].strip()):
        assert text in printed

    # The same prompt (the documents in the demo's new order) through Hugging Face's greedy generate.
    engine = Engine.from_pretrained(config=EngineConfig(threads=2))
    _, asked = demo_example(docs=DOCS)
    prompt = prepare(engine, asked, [Variant("full_recompute", "full_recompute", EngineConfig.ratio)]).prompt()
    assert prompt.total == ex["prompt_tokens"]
    ids = prompt.input_ids.unsqueeze(0).to(engine.adapter.device)
    generated = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS,
                                      do_sample=False, num_beams=1, repetition_penalty=1.0)
    text = engine.tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
    # The demo stops at the end of the answer's first line, so its answer may be a prefix.
    assert full["answer"].strip() and text.startswith(full["answer"])
