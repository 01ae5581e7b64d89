"""OpenAI's logprobs shapes, built from the engine's TokenLogprob entries.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}, where
an echoed prompt token without a logprob (the first one, and those after positions served from
cached chunks) has null in token_logprobs and top_logprobs.
"""

from __future__ import annotations

from typing import Sequence

from cachetune.runtime.decode import TokenLogprob


class TokenTexts:
    """Token id -> the text of that token alone (what logprobs name tokens by), decoded once each."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def _chat_entry(texts: TokenTexts, token: int, logprob: float) -> dict:
    text = texts(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob]) -> dict:
    return {"content": [{**_chat_entry(texts, e.token, e.logprob),
                         "top_logprobs": [_chat_entry(texts, t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(texts: TokenTexts, tokens: Sequence[int], entries: Sequence[TokenLogprob | None],
                        offset: int = 0) -> dict:
    """Logprobs of `tokens` (entries[i] for tokens[i], None where there is none); text offsets
    count from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = texts(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else _top(texts, entry))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _top(texts: TokenTexts, entry: TokenLogprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for token, logprob in entry.top:  # best first: two ids with one text keep the better logprob
        top.setdefault(texts(token), logprob)
    return top


def merge_completion_logprobs(parts: Sequence[dict]) -> dict:
    """One logprobs object from consecutive ones (the echoed prompt's, then the generated text's)."""
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}
