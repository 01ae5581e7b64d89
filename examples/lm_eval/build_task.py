"""Build the small multiple-choice task `cachetune_musique_mc` (musique_mc.jsonl) for lm-evaluation-harness.

    python examples/lm_eval/build_task.py            # writes examples/lm_eval/musique_mc.jsonl

Deterministic (no randomness, no dependencies beyond the standard library). Source: the bundled MuSiQue
sample `cachetune/data/musique_sample.json` (8 CacheBlend rows, CC BY 4.0; see cachetune/data/README.md),
or another file of the same format with --source (e.g. the 150-row shared/data/musique/musique_s.json).

Item j (0 <= j < --items) asks the question of source row q = j % N (N rows), variant v = j // N:
- documents: 2 + j % 3 passages of that row. A "supporting" passage is one whose text contains the gold
  answer (case-insensitive); the item takes supporting[v % len] (when the row has one) at position
  (q + v) % n, and fills the other places with the row's remaining passages from index 3v on (cyclic).
  Passages are stripped of surrounding whitespace, otherwise unchanged.
- choices: the gold answer (the row's answers[0]) at position label = j % 4, and the answers of the
  next rows (q+1+v, q+2+v, ... mod N, skipping the row itself and any answer already taken) elsewhere.
- prompt: "Documents:\n" + "".join(doc + "\n\n" for doc in documents) + "Question: {q}\nAnswer:".
  Every document starts right after a newline and is followed by "\n\n", which is what the server needs
  to find a registered document inside a plain completion prompt (see check_alignment.py).
lm-eval scores " " + choice after the prompt (target_delimiter " ").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_SOURCE = REPO / "cachetune" / "data" / "musique_sample.json"
DEFAULT_OUT = HERE / "musique_mc.jsonl"
DOC_SEPARATOR = "\n\n"
N_CHOICES = 4


def build_prompt(documents: list[str], question: str) -> str:
    return "Documents:\n" + "".join(doc + DOC_SEPARATOR for doc in documents) + f"Question: {question}\nAnswer:"


def build_items(rows: list[dict], n_items: int) -> list[dict]:
    n_rows = len(rows)
    if n_rows < N_CHOICES:
        raise ValueError(f"need at least {N_CHOICES} source rows for {N_CHOICES} distinct choices, got {n_rows}")
    items = []
    for j in range(n_items):
        q, v = j % n_rows, j // n_rows
        row = rows[q]
        gold = row["answers"][0]
        texts = [c["text"].strip() for c in row["ctxs"]]
        supporting = [i for i, t in enumerate(texts) if gold.lower() in t.lower()]
        n_docs = 2 + j % 3
        picked: list[int] = []
        if supporting:
            picked.append(supporting[v % len(supporting)])
        others = [i for i in range(len(texts)) if i not in picked]
        start = (3 * v) % len(others)
        fill = [others[(start + k) % len(others)] for k in range(n_docs - len(picked))]
        if supporting:
            at = (q + v) % n_docs
            ctx_indices = fill[:at] + picked + fill[at:]
        else:
            ctx_indices = fill
        documents = [texts[i] for i in ctx_indices]

        wrong: list[str] = []
        taken = {gold.strip().lower()}
        for d in range(1, n_rows):
            other = rows[(q + d + v) % n_rows]
            if other is row:
                continue
            answer = other["answers"][0]
            if answer.strip().lower() in taken:
                continue
            wrong.append(answer)
            taken.add(answer.strip().lower())
            if len(wrong) == N_CHOICES - 1:
                break
        if len(wrong) < N_CHOICES - 1:
            raise ValueError(f"row {q}: not enough distinct other answers for {N_CHOICES} choices")
        label = j % N_CHOICES
        choices = wrong[:label] + [gold] + wrong[label:]
        items.append({
            "id": f"musique_mc_{j:02d}",
            "source_row": q,
            "ctx_indices": ctx_indices,
            "supporting_in_documents": bool(supporting),
            "question": row["question"],
            "answer": gold,
            "documents": documents,
            "prompt": build_prompt(documents, row["question"]),
            "choices": choices,
            "label": label,
        })
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help=f"CacheBlend-format JSON [{DEFAULT_SOURCE}]")
    p.add_argument("--items", type=int, default=20, help="items to write [20]")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSONL to write [{DEFAULT_OUT}]")
    args = p.parse_args(argv)
    rows = json.loads(args.source.read_text(encoding="utf-8"))
    items = build_items(rows, args.items)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n")
    n_docs = len({d for item in items for d in item["documents"]})
    print(f"wrote {args.out}: {len(items)} items, {n_docs} distinct documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
