"""Check that every document of musique_mc.jsonl tokenizes, inside the token ids lm-eval sends, to exactly
the tokens the server registers for it (so `cachetune serve` can find it and reuse its KV).

    python examples/lm_eval/check_alignment.py --tokenizer /tmp/smollm2-tokenizer

Needs `transformers` (any venv that has it: the project's, or the lm-eval one). For each item and each
choice it rebuilds what lm-eval's `local-completions` sends with tokenized_requests=True:
    context_enc = tok(prompt); whole_enc = tok(prompt + " " + choice)   (no special tokens)
    sent = context_enc + whole_enc[len(context_enc):] = whole_enc
and checks, for each document d of the item:
  1. registered = tok(d + "\n\n") (what POST /v1/documents caches), minus its trailing newline-only tokens,
     equals tok(d) (the text alone);
  2. a token of `sent` starts exactly at d's first character, the token before it ends with "\n",
     sent[t : t + len(registered)] == registered, and the tokens right after it are exactly "\n\n";
  3. tok(prompt) is a prefix of tok(prompt + " " + choice) (lm-eval's context/continuation split).
Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def newline_only(tokenizer, token_id: int) -> bool:
    text = tokenizer.decode([token_id])
    return bool(text) and set(text) == {"\n"}


def find(haystack: list[int], needle: list[int]) -> list[int]:
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i:i + n] == needle]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory (or hub name)")
    p.add_argument("--data", type=Path, default=HERE / "musique_mc.jsonl")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)

    def enc(text: str, **kw) -> list[int]:
        return tok(text, add_special_tokens=False, **kw)["input_ids"]

    items = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines() if line.strip()]
    failures: list[str] = []
    checked_docs = checked_requests = 0
    trailing: dict[tuple, int] = {}
    lengths = []
    for item in items:
        prompt, docs = item["prompt"], item["documents"]
        # character offset of every document in the prompt, from the prompt's construction rule
        starts, at = [], len("Documents:\n")
        assert prompt.startswith("Documents:\n")
        for d in docs:
            assert prompt[at:at + len(d) + 2] == d + "\n\n", item["id"]
            starts.append(at)
            at += len(d) + 2
        context_enc = enc(prompt)
        for choice in item["choices"]:
            whole = tok(prompt + " " + choice, add_special_tokens=False, return_offsets_mapping=True)
            sent, offsets = whole["input_ids"], whole["offset_mapping"]
            checked_requests += 1
            lengths.append(len(sent))
            where = f"{item['id']} choice {choice!r}"
            if sent[:len(context_enc)] != context_enc:
                failures.append(f"{where}: tok(prompt) is not a prefix of tok(prompt + ' ' + choice)")
            for k, (d, start) in enumerate(zip(docs, starts)):
                registered = enc(d + "\n\n")
                tail = []
                while registered and newline_only(tok, registered[-1]):
                    tail.insert(0, registered.pop())
                trailing[tuple(tail)] = trailing.get(tuple(tail), 0) + 1
                if registered != enc(d):
                    failures.append(f"{where} doc {k}: tok(doc + '\\n\\n') minus newlines != tok(doc)")
                t = next((i for i, (s, _) in enumerate(offsets) if s == start), None)
                if t is None:
                    failures.append(f"{where} doc {k}: no token starts at the document's first character")
                    continue
                checked_docs += 1
                if t == 0 or not tok.decode([sent[t - 1]]).endswith("\n"):
                    failures.append(f"{where} doc {k}: the token before it does not end with a newline")
                if sent[t:t + len(registered)] != registered:
                    failures.append(f"{where} doc {k}: prompt tokens differ from the registered tokens")
                    continue
                end_char = start + len(d)
                u = t + len(registered)
                if offsets[u][0] != end_char:
                    failures.append(f"{where} doc {k}: the document's last token runs past its text")
                v = next((i for i in range(u, len(offsets)) if offsets[i][1] >= end_char + 2), None)
                if v is None or offsets[v][1] != end_char + 2 or tok.decode(sent[u:v + 1]) != "\n\n":
                    failures.append(f"{where} doc {k}: not followed by exactly the tokens of '\\n\\n'")
                hits = find(sent, registered)
                if hits != [t]:
                    failures.append(f"{where} doc {k}: registered tokens found at {hits}, expected [{t}]")
    print(f"items {len(items)}, requests (item x choice) {checked_requests}, document placements checked "
          f"{checked_docs}, prompt+choice tokens min/mean/max {min(lengths)}/{sum(lengths) / len(lengths):.0f}/"
          f"{max(lengths)}")
    print("trailing newline tokens of tok(doc + '\\n\\n'): "
          + ", ".join(f"{list(k)} x{n}" for k, n in sorted(trailing.items())))
    example = items[0]["documents"][0]
    print(f"example: tok(doc + '\\n\\n')[-3:] = {enc(example + chr(10) * 2)[-3:]}, "
          f"in the prompt the doc is followed by {enc(items[0]['prompt'])[len(enc('Documents:' + chr(10) + example)) - 0:][:3]}")
    if failures:
        print(f"FAILED: {len(failures)} problems")
        for f in failures[:50]:
            print("  " + f)
        return 1
    print("OK: every document aligns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
