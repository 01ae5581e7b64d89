"""Token ids to streamed text: whole characters only, and stop strings cut before they are sent."""

from __future__ import annotations


class TextStream:
    """Feed generated token ids one at a time; each `add` returns the text safe to send now.

    Text is held back while it ends in an incomplete character or in what could be the start of a
    stop string. The first stop string found ends the text before it (`stopped` is then True).

    NOTE: each token decodes only a short tail, not every id so far: the new text is the tail
    ids[head:] decoded minus ids[head:tail] decoded (tokenizers merge bytes across tokens and some
    drop a leading space at the start of a decode, which the difference cancels); once it ends in a
    whole character it is settled and the window moves on."""

    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer, self.stops = tokenizer, list(stops or ())
        self.ids: list[int] = []
        self.text = ""      # the text sent so far
        self.stopped = False
        self._settled = ""  # the decoded text of ids[:self._tail]
        self._head = self._tail = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decoded(self) -> str:
        """The decoded text of every id so far."""
        window = self._decode(self.ids[self._head:])
        new = window[len(self._decode(self.ids[self._head:self._tail])):]
        if new.endswith("\ufffd"):
            return self._settled + new  # a character still being assembled: the window stays
        self._settled += new
        self._head, self._tail = self._tail, len(self.ids)
        return self._settled

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        full = self._decoded()
        at = self._stop_at(full)
        if at is not None:
            self.stopped = True
            return self._send(full[:at])
        end = len(full)
        while end > len(self.text) and full[end - 1] == "\ufffd":  # a character still being assembled
            end -= 1
        end = min(end, len(full) - self._partial_stop(full[:end]))
        return self._send(full[:max(end, len(self.text))])

    def flush(self) -> str:
        """The held-back rest at the end of generation."""
        return "" if self.stopped else self._send(self._decoded())

    def _send(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text = upto
        return delta

    def _stop_at(self, full: str) -> int | None:
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        found = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
