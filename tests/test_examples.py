"""The scripts in examples/ run as a user runs them: their own process, the official openai client,
against a real server (here over the tiny model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_server import Served

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def server_url():
    with Served() as s:
        yield s.url


def test_chat_example_answers_plain_and_streamed_with_cached_tokens(server_url):
    out = _run("chat.py", "--url", f"{server_url}/v1")
    lines = out.splitlines()
    assert lines[0].startswith("plain:") and lines[2].startswith("streamed:")
    assert "from cache" in lines[1] and not lines[1].strip().startswith("0 ")
    assert "cached prompt tokens" in lines[-1]


def test_rag_example_registers_documents_and_answers_each_question(server_url, tmp_path):
    docs = []
    for i, text in enumerate(["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11", "w12 w13 w14"]):
        docs.append(tmp_path / f"doc{i}.txt")
        docs[-1].write_text(text)
    out = _run("rag.py", "--url", server_url, "--docs", *map(str, docs), "--question", "w2 w3", "--question", "w13")
    assert "registered 3 documents" in out
    assert out.count("\nQ: ") == 2 and out.count("\nA: ") == 2
    assert "documents: doc0.txt" in out and "documents: doc2.txt" in out  # the toy retriever's pick
    assert out.count("prompt tokens from cache") == 2
