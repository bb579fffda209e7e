"""Reasoning split: `<think>…</think>` text -> reasoning_content, the rest -> content.

The text arrives in arbitrary pieces (one token may be "</thi"), so anything
that could still become a tag is held back until it either completes the tag
or cannot any more; a tag never leaks into either field, however the model's
tokens cut it. A think block counts only at the start of the reply (after
whitespace) or when the prompt left one open (an assistant prefix `<think>`,
or a template that opens the block itself); `<think>` later in an answer is
just text.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
START, THINK, ANSWER = 0, 1, 2


def prompt_opens_think(prompt_text: str) -> bool:
    """Does the prompt end inside a think block?"""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ThinkSplitter:
    def __init__(self, thinking: bool = False):
        self.state = THINK if thinking else START
        self.pending = ""
        self.saw_think = thinking
        self._strip_answer = False  # the newlines right after </think> are layout, not answer

    @property
    def thinking(self) -> bool:
        """Inside a think block now (not merely able to open one)."""
        return self.state == THINK

    def push(self, text: str) -> tuple[str, str]:
        """New text -> (reasoning, content) safe to emit now."""
        buf = self.pending + text
        self.pending = ""
        reasoning = content = ""
        while buf:
            if self.state == START:
                s = buf.lstrip()
                if s.startswith(OPEN):
                    self.state, self.saw_think, buf = THINK, True, s[len(OPEN):]
                    continue
                if OPEN.startswith(s):  # whitespace and a partial tag: wait
                    self.pending = buf
                    return reasoning, content
                self.state = ANSWER
                continue
            if self.state == THINK:
                i = buf.find(CLOSE)
                if i >= 0:
                    reasoning += buf[:i]
                    buf = buf[i + len(CLOSE):]
                    self.state, self._strip_answer = ANSWER, True
                    continue
                hold = _partial_suffix(buf, CLOSE)
                reasoning += buf[: len(buf) - hold]
                self.pending = buf[len(buf) - hold:]
                return reasoning, content
            if self._strip_answer:
                buf = buf.lstrip("\n")
                if not buf:
                    return reasoning, content
                self._strip_answer = False
            content += buf
            buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """End of the reply: whatever was held back, where it belongs."""
        buf, self.pending = self.pending, ""
        if self.state == THINK:
            return buf, ""
        return "", buf.lstrip("\n") if self._strip_answer else buf


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def split_delta(sp: ThinkSplitter, d) -> tuple[str, str]:
    """A Delta's text as (reasoning, content); a finishing delta also flushes what the splitter held."""
    r, c = sp.push(d.text)
    if d.finish:
        r2, c2 = sp.flush()
        r, c = r + r2, c + c2
    return r, c
