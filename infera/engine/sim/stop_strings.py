"""Stop strings for the simulated engine's output: :class:`StopStringMatcher` builds the output
text token by token, cuts it at the first stop string and, when streaming, holds back the tail
that could still begin one, as vLLM's detokenizer does.
"""
from __future__ import annotations


class StopStringMatcher:
    """Builds output text token by token, cutting at the first stop string (which is not returned).

    When streaming with stop strings, the last ``max(len(stop)) - 1`` characters are held back
    until they can no longer start a stop string -- vLLM's detokenizer does the same.
    """

    def __init__(self, stop: list[str], hold_back: bool) -> None:
        self.stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._hold = max(self._max_stop_len - 1, 0) if hold_back else 0
        self.text = ""
        self._released = 0
        self.matched: str | None = None

    def add(self, piece: str) -> str:
        """Append a token's text; return the newly releasable text. Sets ``matched`` on a stop hit."""
        start = max(len(self.text) - self._max_stop_len + 1, 0)
        self.text += piece
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                idx, self.matched = min(hits)
                self.text = self.text[:idx]
                return self.flush()
        end = len(self.text) - self._hold
        if end <= self._released:
            return ""
        delta = self.text[self._released:end]
        self._released = end
        return delta

    def flush(self) -> str:
        delta = self.text[self._released:]
        self._released = len(self.text)
        return delta
