"""A small RAG loop over a cachetune server: register documents once, then ask questions over any
subset of them in any order; each answer says how much of its prompt was served from cached KV.

    cachetune serve &
    python examples/rag.py [--url http://127.0.0.1:8000] [--docs FILE ...] [--question "..." ...]

Without --docs it uses three built-in passages. Retrieval here is a toy (word overlap); in a real
application it is your retriever, and the ids it returns are what you send in `documents`.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import httpx
from openai import OpenAI

PASSAGES = {
    "marie-curie": "Marie Curie won the Nobel Prize in Physics in 1903 and the Nobel Prize in Chemistry in 1911.",
    "pierre-curie": "Pierre Curie shared the 1903 Nobel Prize in Physics with Marie Curie and Henri Becquerel.",
    "radium": "Radium was discovered by Marie and Pierre Curie in 1898; its name comes from the Latin radius, ray.",
}
QUESTIONS = ["Who shared the 1903 Nobel Prize in Physics?", "When was radium discovered?"]


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def retrieve(question: str, texts: dict[str, str], k: int = 2) -> list[str]:
    """The names of the k texts sharing the most words with the question."""
    return sorted(texts, key=lambda name: -len(words(question) & words(texts[name])))[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--docs", nargs="*", help="text files, one document each")
    parser.add_argument("--question", action="append", help="repeat for several (default: two examples)")
    args = parser.parse_args()
    key = os.environ.get("CACHETUNE_API_KEY", "none")
    texts = {Path(p).name: Path(p).read_text() for p in args.docs} if args.docs else PASSAGES

    # Register once: each text is encoded and ranked now, and later requests only reuse it.
    http = httpx.Client(base_url=args.url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    registered = http.post("/v1/documents", json={"texts": list(texts.values())})
    registered.raise_for_status()
    ids = {name: doc["id"] for name, doc in zip(texts, registered.json()["data"])}
    print(f"registered {len(ids)} documents")

    client = OpenAI(base_url=f"{args.url}/v1", api_key=key)
    model = client.models.list().data[0].id
    for question in args.question or QUESTIONS:
        names = retrieve(question, texts)
        answer = client.chat.completions.create(
            model=model, max_tokens=48, temperature=0,
            messages=[{"role": "system", "content": "Answer briefly from the passages."},
                      {"role": "user", "content": question}],
            extra_body={"documents": [ids[n] for n in names], "method": "cachetune"})
        extras = answer.model_extra["cachetune"]
        print(f"\nQ: {question}\n   documents: {', '.join(names)}\nA: {answer.choices[0].message.content.strip()}")
        print(f"   {answer.usage.prompt_tokens_details.cached_tokens}/{answer.usage.prompt_tokens} prompt tokens "
              f"from cache, {extras['recomputed_tokens']} recomputed, first token after {extras['ttft_ms']:.0f} ms")


if __name__ == "__main__":
    main()
