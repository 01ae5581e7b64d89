"""Registered documents found inside plain prompts, so clients that cannot send `documents` reuse them.

A client that only sends a prompt (token ids from lm-evaluation-harness, a text from any OpenAI SDK)
gets the same reuse as one that names its documents: every registered document whose tokens appear
in the prompt becomes a chunk there. A document's tokens are those of its text alone (`body`), which
is what the text tokenizes to inside a prompt when it starts on a token boundary (after a newline,
say); the separator a stored chunk ends with may tokenize differently before the next text, so it
is matched only when the prompt has it too.

    index = DocumentIndex(capacity=4096)
    index.add(chunk_id, body_ids, chunk_ids)           # at registration
    index.find(prompt_ids)                              # -> [Found(start, end, chunk_id or None)]
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from cachetune.lru import LRUDict

KEY_TOKENS = 8  # a document is looked up by its first tokens; shorter documents by all of theirs


class Found(NamedTuple):
    start: int              # prompt positions [start, end) are the document
    end: int
    chunk_id: str | None    # the registered chunk when the prompt holds all of its tokens (separator
                            # included); None: the document's body alone (a chunk of `ids[start:end]`)


class Entry(NamedTuple):
    chunk_id: str
    body: tuple[int, ...]   # tokens of the text alone
    chunk: tuple[int, ...]  # tokens of the stored chunk (the body, then the separator's tokens)


class DocumentIndex:
    """The most recently registered `capacity` documents, by their first tokens. Safe to use from
    several threads (the engine thread registers, the tokenizer thread searches)."""

    def __init__(self, capacity: int):
        self._entries: LRUDict[str, Entry] = LRUDict(capacity)
        self._by_key: dict[tuple[int, ...], set[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, chunk_id: str, body: list[int], chunk: list[int]) -> None:
        if not body:
            return
        with self._lock:
            self._add(chunk_id, body, chunk)

    def _add(self, chunk_id: str, body: list[int], chunk: list[int]) -> None:
        self._remove(chunk_id)
        self._entries.put(chunk_id, Entry(chunk_id, tuple(body), tuple(chunk)))
        self._by_key.setdefault(tuple(body[:KEY_TOKENS]), set()).add(chunk_id)
        if len(self._by_key) > 2 * self._entries.capacity:
            self._prune()

    def remove(self, chunk_id: str) -> None:
        with self._lock:
            self._remove(chunk_id)

    def _remove(self, chunk_id: str) -> None:
        entry = self._entries.pop(chunk_id)
        if entry is not None:
            ids = self._by_key.get(entry.body[:KEY_TOKENS], set())
            ids.discard(chunk_id)
            if not ids:
                self._by_key.pop(entry.body[:KEY_TOKENS], None)

    def _prune(self) -> None:
        """Drop the ids (and keys) of entries the LRU let go."""
        for key in list(self._by_key):
            self._by_key[key] = {i for i in self._by_key[key] if i in self._entries}
            if not self._by_key[key]:
                del self._by_key[key]

    def find(self, prompt: list[int]) -> list[Found]:
        """The registered documents in `prompt`, left to right, not overlapping; where several
        match at one place the longest wins."""
        with self._lock:
            return self._find(prompt) if self._by_key else []

    def _find(self, prompt: list[int]) -> list[Found]:
        lengths = sorted({len(k) for k in self._by_key}, reverse=True)
        found, at, n = [], 0, len(prompt)
        while at < n:
            best = None
            for size in lengths:
                for cid in self._by_key.get(tuple(prompt[at:at + size]), ()):
                    entry = self._entries.get(cid)
                    if entry is None or tuple(prompt[at:at + len(entry.body)]) != entry.body:
                        continue
                    whole = tuple(prompt[at:at + len(entry.chunk)]) == entry.chunk
                    match = Found(at, at + len(entry.chunk), cid) if whole else Found(at, at + len(entry.body), None)
                    if best is None or match.end > best.end:
                        best = match
            if best is None:
                at += 1
            else:
                found.append(best)
                at = best.end
        return found
