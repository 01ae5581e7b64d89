"""The official `openai` client against a cachetune server: one plain and one streamed chat completion.

    cachetune serve &                 # http://127.0.0.1:8000, the bundled SmolLM2-135M-Instruct
    python examples/chat.py [--url http://127.0.0.1:8000/v1]

Documents go in the extra body field `documents` (ids from POST /v1/documents, or texts, cached on
first sight); `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens came from cache.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

PASSAGES = [
    "The Eiffel Tower was completed in 1889 for the Exposition Universelle in Paris.",
    "Gustave Eiffel's company designed and built the tower; Maurice Koechlin drew its first sketch.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key=os.environ.get("CACHETUNE_API_KEY", "none"))
    model = client.models.list().data[0].id
    question = [{"role": "user", "content": "When was the Eiffel Tower completed?"}]

    answer = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0,
                                            extra_body={"documents": PASSAGES})
    print("plain:   ", answer.choices[0].message.content)
    print(f"          {answer.usage.prompt_tokens} prompt tokens, "
          f"{answer.usage.prompt_tokens_details.cached_tokens} from cache")

    stream = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"documents": PASSAGES[::-1]})  # any order reuses
    print("streamed: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n          {chunk.usage.prompt_tokens_details.cached_tokens} cached prompt tokens")


if __name__ == "__main__":
    main()
