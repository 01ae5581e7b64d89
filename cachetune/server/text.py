"""Token ids to streamed text: whole characters only, and stop strings cut before they are sent."""

from __future__ import annotations


class TextStream:
    """Feed generated token ids one at a time; each `add` returns the text safe to send now.

    Text is decoded from all ids so far (tokenizers merge bytes across tokens), and held back while it
    ends in an incomplete character or in what could be the start of a stop string. The first stop
    string found ends the text before it (`stopped` is then True)."""

    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer, self.stops = tokenizer, list(stops or ())
        self.ids: list[int] = []
        self.text = ""      # the text sent so far
        self.stopped = False

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

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
