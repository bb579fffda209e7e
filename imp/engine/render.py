"""Token ids -> text, where the text is sent: the one place stop strings and detokenization run.

The engine sends each request's tokens as token-id Deltas (the detok actor only fans a
step's TokenBatch out to ingress). Whatever the process layout, the port's stream renders
them here: in-process (`imp.engine.local`) and in an API-server process
(`imp.engine.remote`) alike, `RenderedStream` decodes each choice incrementally (a
multibyte character split across tokens is held back, never sent as U+FFFD), matches
the stop strings (text that may still become one is held back), merges the deltas a
slow reader has not taken yet into one, and asks the engine to stop a choice whose stop
string matched (`stop_choice`), so its KV is freed at once rather than at max_tokens.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from imp.actors.channel import Channel
from imp.engine.port import StreamItem, Submission
from imp.messages import Delta, DetokOpen, FinishReason, TokenOut
from imp.text.stops import StopMatcher


class _Choice:
    __slots__ = ("detok", "stops", "done", "closed", "generated")

    def __init__(self, detok, stops: list[str]):
        self.detok = detok
        self.stops = StopMatcher(stops)
        self.done = False  # the client has its last delta; later tokens are dropped
        self.closed = False  # the scheduler has finished this choice
        # what a stop string's last delta reports as completion_tokens (the scheduler's own last TokenOut comes
        # after the client's end and is dropped): tokens generated through the one that completed the stop string
        self.generated = 0


class Renderer:
    """One request's text: `render(TokenOut)` -> (the Delta to send or None, whether a
    stop string ended that choice just now, so it should be cancelled upstream)."""

    __slots__ = ("tokenizer", "op", "choices", "prompt_len")

    def __init__(self, tokenizer, op: DetokOpen, prompt_len: int = 0):
        self.tokenizer = tokenizer
        self.op = op
        self.choices: dict[int, _Choice] = {}
        self.prompt_len = prompt_len  # what a stop string's last delta reports as prompt_tokens

    def _choice(self, index: int) -> _Choice:
        ch = self.choices.get(index)
        if ch is None:
            from imp.text.tokenizer import IncrementalDetokenizer

            det = IncrementalDetokenizer(self.tokenizer, prompt_tail=list(self.op.prompt_tail),
                                         skip_special=self.op.skip_special)
            ch = self.choices[index] = _Choice(det, list(self.op.stop))
        return ch

    def render(self, m: TokenOut) -> tuple[Delta | None, bool]:
        ch = self._choice(m.index)
        final = m.finish != FinishReason.NONE
        if ch.done:
            if final:
                ch.closed = True
            return None, False
        ch.generated += len(m.token_ids)
        text = ch.detok.push(m.token_ids)
        if final:
            text += ch.detok.flush()
        out, stopped = ch.stops.push(text)
        finish = m.finish
        if stopped:
            ch.done = True
            finish = FinishReason.STOP
            if not final:
                m = msgspec.structs.replace(m, prompt_tokens=self.prompt_len, completion_tokens=ch.generated)
        elif final:
            out += ch.stops.flush()
        if final:
            ch.done = ch.closed = True
        return Delta(m, out, finish, ch.stops.hit if stopped else ""), stopped and not final

    @property
    def finished(self) -> bool:
        """Every choice has closed upstream: nothing more will come for this request."""
        return len(self.choices) >= self.op.n and all(c.closed for c in self.choices.values())


def merge(a: Delta, b: Delta) -> Delta:
    """Two consecutive Deltas of one choice as one (b is the later): a stream that is behind
    writes one chunk for the tokens that are waiting, not one each."""
    ao, bo = a.out, b.out
    out = msgspec.structs.replace(
        bo, token_ids=ao.token_ids + bo.token_ids, logprobs=ao.logprobs + bo.logprobs,
        prompt_tokens=bo.prompt_tokens or ao.prompt_tokens, cached_tokens=bo.cached_tokens or ao.cached_tokens,
        prompt_logprobs=ao.prompt_logprobs or bo.prompt_logprobs, spec_drafted=ao.spec_drafted + bo.spec_drafted,
        spec_accepted=ao.spec_accepted + bo.spec_accepted, spec_verify_steps=ao.spec_verify_steps + bo.spec_verify_steps,
        spec_declined=bo.spec_declined or ao.spec_declined)
    return Delta(out, a.text + b.text, b.finish, b.stop_str)


def mergeable(a: Delta, b) -> bool:
    """b (a queue item) can join Delta a: the same choice, neither an end nor an error."""
    if a.finish != FinishReason.NONE or a.out.error:
        return False
    t = type(b)
    if t is tuple:  # a decode lane row: (choice index, token id)
        return b[0] == a.out.index
    return t is Delta and b.out.index == a.out.index and not b.out.error


class RenderedStream:
    """One request's output as HTTP reads it: the engine's items (token-id Deltas, a decode lane
    row's (choice index, token id), or a last Reject / Fault) from `queue`, rendered. Ends once every choice has its last delta (or the
    Reject / Fault); `on_end` runs once when it ends or is closed early (closing early cancels
    the request upstream: that is the caller's `on_end`)."""

    def __init__(self, tokenizer, sub: Submission, queue: Channel,
                 stop_choice: Callable[[int], None], on_end: Callable[[], None]):
        self.req_id = sub.req_id
        self.n = sub.n
        self.queue = queue
        self.renderer = Renderer(tokenizer, DetokOpen(sub.req_id, sub.n, sub.stop, True, sub.prompt[-4:]),
                                 len(sub.prompt))
        self.stop_choice = stop_choice
        self.on_end = on_end
        self.ended = False

    def __aiter__(self):
        return self

    def _all_done(self) -> bool:
        chs = self.renderer.choices
        return len(chs) >= self.n and all(c.done for c in chs.values())

    def _render(self, item) -> Delta | None:
        m = TokenOut(self.req_id, item[0], (item[1],)) if type(item) is tuple else item.out
        d, stopped = self.renderer.render(m)
        if stopped:
            self.stop_choice(m.index)
        return d

    async def __anext__(self) -> StreamItem:
        q = self.queue
        while not self.ended:
            item = await q.get()
            t = type(item)
            if t is not Delta and t is not tuple:
                self._end()  # Reject or Fault: the last item
                return item
            d = self._render(item)
            if d is None:
                continue
            # the tokens that are already here go out as one chunk (this stream is behind)
            while not q.empty() and mergeable(d, q.peek()):
                nd = self._render(q.get_nowait())
                if nd is not None:
                    d = merge(d, nd)
            if self._all_done():
                self._end()
            return d
        raise StopAsyncIteration

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.on_end()

    async def aclose(self) -> None:
        self._end()
