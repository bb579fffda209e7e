"""Stop strings over a text stream.

A stop string can be split across tokens, so text that could still be the
start of a stop string is held back until it either completes the stop (and
is cut, never shown) or stops matching (and is released).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.hit = ""  # the stop string that matched, once stopped

    def push(self, text: str) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit, whether a stop matched)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            # the stop that completes first wins, as it would token by token: a
            # longer one starting earlier but ending later never gets the chance
            end = min(hits)[0]
            _, start, self.hit = min(h for h in hits if h[0] == end)
            self.pending = ""
            self.stopped = True
            return buf[:start], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
