"""Detokenizer actor: token ids -> text deltas, stop strings, fan-out.

One `Renderer` per request, one state per choice. Text is decoded incrementally
(a multibyte character split across tokens is held back, never sent as U+FFFD)
and passed through the stop matcher. When a choice hits a stop string it is
cancelled upstream so it frees its KV at once.

The renderer is also what an API-server process runs on its side of the
process boundary (`imp.engine.remote`): there the engine's detok actor runs
with no tokenizer (`raw`) and passes token ids through untouched, so text is
made where it is sent and never crosses per token.
"""

from __future__ import annotations

import msgspec

from imp.actors.base import Actor, Bus
from imp.text.stops import StopMatcher
from imp.messages import (
    Cancel,
    Delta,
    DeltaBatch,
    DetokClose,
    DetokOpen,
    FinishReason,
    Msg,
    TokenBatch,
    TokenOut,
)


class _Choice:
    __slots__ = ("detok", "stops", "done", "closed")

    def __init__(self, detok, stops: list[str]):
        self.detok = detok
        self.stops = StopMatcher(stops)
        self.done = False  # the client has its last delta; later tokens are dropped
        self.closed = False  # the scheduler has finished this choice


class Renderer:
    """One request's text: `render(TokenOut)` -> (the Delta to send or None, whether a
    stop string ended that choice just now, so it should be cancelled upstream)."""

    __slots__ = ("tokenizer", "op", "choices")

    def __init__(self, tokenizer, op: DetokOpen):
        self.tokenizer = tokenizer
        self.op = op
        self.choices: dict[int, _Choice] = {}

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
        text = ch.detok.push(m.token_ids)
        if final:
            text += ch.detok.flush()
        out, stopped = ch.stops.push(text)
        finish = m.finish
        if stopped:
            ch.done = True
            finish = FinishReason.STOP
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
        prompt_tokens=bo.prompt_tokens or ao.prompt_tokens, prompt_logprobs=ao.prompt_logprobs or bo.prompt_logprobs)
    return Delta(out, a.text + b.text, b.finish, b.stop_str)


def mergeable(a: Delta, b) -> bool:
    return (type(b) is Delta and b.out.index == a.out.index and a.finish == FinishReason.NONE
            and not a.out.error and not b.out.error)


class DetokActor(Actor):
    name = "detok"

    def __init__(self, bus: Bus, tokenizer, raw: bool = False):
        """raw: pass token ids through as Deltas without text (an API-server process
        renders them, `imp.engine.remote`); stop strings are matched there too."""
        super().__init__(bus)
        self.tokenizer = tokenizer
        self.raw = raw
        self.reqs: dict[str, Renderer] = {}
        self.opens: dict[str, DetokOpen] = {}

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, DetokOpen):
            if not self.raw:
                self.opens[msg.req_id] = msg
        elif isinstance(msg, DetokClose):
            self.opens.pop(msg.req_id, None)
            self.reqs.pop(msg.req_id, None)
        elif isinstance(msg, TokenBatch):
            if self.raw:
                self.send("ingress", DeltaBatch(tuple(Delta(t, "", t.finish) for t in msg.outs)))
                return
            deltas: list[Delta] = []
            for t in msg.outs:
                self._on_tokens(t, deltas)
            if deltas:
                self.send("ingress", DeltaBatch(tuple(deltas)))
        elif isinstance(msg, TokenOut):
            if self.raw:
                self.send("ingress", Delta(msg, "", msg.finish))
                return
            deltas = []
            self._on_tokens(msg, deltas)
            if deltas:
                self.send("ingress", deltas[0])

    def _on_tokens(self, m: TokenOut, deltas: list[Delta]) -> None:
        r = self.reqs.get(m.req_id)
        if r is None:
            r = self.reqs[m.req_id] = Renderer(self.tokenizer, self.opens.get(m.req_id) or DetokOpen(m.req_id))
        d, stopped = r.render(m)
        if d is not None:
            deltas.append(d)
        if stopped:  # free this choice's KV now rather than at max_tokens
            self.send("admission", Cancel(m.req_id, FinishReason.STOP, m.index))
        if r.finished:
            self.reqs.pop(m.req_id, None)
            self.opens.pop(m.req_id, None)
