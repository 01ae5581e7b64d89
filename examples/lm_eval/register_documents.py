"""Register every document of an lm-eval task's JSONL with a running `cachetune serve` (POST /v1/documents).

    python examples/lm_eval/register_documents.py --url http://127.0.0.1:8000 [--data musique_mc.jsonl]

Standard library only. Sends each distinct document once, in order of first appearance, in calls of at
most --per-call texts (the server's --max-documents, 64 by default). The server caches the KV of
`text + "\n\n"` and later finds the text's tokens inside plain completion prompts. With --out, writes
{"url", "documents": [{"id", "tokens", "chars"}]} as JSON. API key: --api-key or $CACHETUNE_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def post(url: str, body: dict, api_key: str | None, timeout: float) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"POST {url} -> HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root [http://127.0.0.1:8000]")
    p.add_argument("--data", type=Path, default=HERE / "musique_mc.jsonl", help="JSONL with a 'documents' list per line")
    p.add_argument("--field", default="documents", help="the JSONL field holding the documents [documents]")
    p.add_argument("--per-call", type=int, default=64, help="texts per POST [64]")
    p.add_argument("--api-key", default=os.environ.get("CACHETUNE_API_KEY"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, help="write the registered ids here (JSON)")
    args = p.parse_args(argv)

    texts: list[str] = []
    seen: set[str] = set()
    for line in args.data.read_text(encoding="utf-8").splitlines():
        if line.strip():
            for text in json.loads(line)[args.field]:
                if text not in seen:
                    seen.add(text)
                    texts.append(text)
    url = args.url.rstrip("/") + "/v1/documents"
    registered = []
    for i in range(0, len(texts), args.per_call):
        batch = texts[i:i + args.per_call]
        answer = post(url, {"texts": batch}, args.api_key, args.timeout)
        for text, doc in zip(batch, answer["data"]):
            registered.append({"id": doc["id"], "tokens": doc["tokens"], "chars": len(text)})
    total = sum(d["tokens"] for d in registered)
    print(f"registered {len(registered)} documents ({total} tokens) at {url}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"url": url, "documents": registered}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
