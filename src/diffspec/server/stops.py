"""Stop strings over a text stream that arrives in blocks (one block per accepted round).

The engine knows stop *tokens*; OpenAI's `stop` is about *text*, and a stop string may be split
across two rounds' blocks ("...wor" | "ld."), or sit inside one block. `StopMatcher` releases
text only once it is sure it is not the beginning of a stop string:

- every block is appended to a pending buffer;
- the earliest occurrence of any stop string in the buffer ends the stream: the text before it
  is released, the stop string and everything after it never are;
- otherwise the longest suffix of the buffer that is a proper prefix of some stop string is held
  back (it may be completed by the next block) and the rest is released;
- at the end of generation `flush()` releases what is still held (it was not a stop string).

Released text is therefore always a prefix of the model's text, and never contains or ends
inside a stop string. With no stop strings, every block is released at once.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feed text blocks, get back what is safe to release; see the module docstring."""

    def __init__(self, stops: Sequence[str] = ()):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(stops)
        self._pending = ""
        self.released_chars = 0   # characters released so far
        self.stopped = False

    def feed(self, block: str) -> str:
        """Add a block; return the text that can be released now (maybe ''). Sets `stopped` when a
        stop string appeared: then the returned text ends right before it and later feeds return ''."""
        if self.stopped:
            return ""
        if not self.stops:
            self.released_chars += len(block)
            return block
        buf = self._pending + block
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            self.released_chars += cut
            return buf[:cut]
        hold = self._held_suffix(buf)
        out, self._pending = buf[: len(buf) - hold], buf[len(buf) - hold:]
        self.released_chars += len(out)
        return out

    def flush(self) -> str:
        """Generation ended without a stop string: release whatever is still held back."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        self.released_chars += len(out)
        return out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
