"""Detokenizer actor: token ids -> text deltas, stop strings, fan-out.

One state per (request, choice). Text is decoded incrementally (a multibyte
character split across tokens is held back, never sent as U+FFFD) and passed
through the stop matcher. When every choice of a request has hit a stop
string, that choice is cancelled upstream so it frees its KV at once.
"""

from __future__ import annotations

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


class DetokActor(Actor):
    name = "detok"

    def __init__(self, bus: Bus, tokenizer):
        super().__init__(bus)
        self.tokenizer = tokenizer
        self.reqs: dict[str, dict[int, _Choice]] = {}
        self.opens: dict[str, DetokOpen] = {}

    def _choice(self, req_id: str, index: int) -> _Choice:
        from imp.text.tokenizer import IncrementalDetokenizer

        choices = self.reqs.setdefault(req_id, {})
        ch = choices.get(index)
        if ch is None:
            op = self.opens.get(req_id) or DetokOpen(req_id)
            det = IncrementalDetokenizer(
                self.tokenizer, prompt_tail=list(op.prompt_tail), skip_special=op.skip_special
            )
            ch = choices[index] = _Choice(det, list(op.stop))
        return ch

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, DetokOpen):
            self.opens[msg.req_id] = msg
        elif isinstance(msg, DetokClose):
            self.opens.pop(msg.req_id, None)
            self.reqs.pop(msg.req_id, None)
        elif isinstance(msg, TokenBatch):
            deltas: list[Delta] = []
            for t in msg.outs:
                self._on_tokens(t, deltas)
            if deltas:
                self.send("ingress", DeltaBatch(tuple(deltas)))
        elif isinstance(msg, TokenOut):
            deltas = []
            self._on_tokens(msg, deltas)
            if deltas:
                self.send("ingress", deltas[0])

    def _on_tokens(self, m: TokenOut, deltas: list[Delta]) -> None:
        ch = self._choice(m.req_id, m.index)
        final = m.finish != FinishReason.NONE
        if ch.done:
            if final:
                self._forget(m.req_id, m.index)
            return
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
        deltas.append(Delta(m, out, finish, ch.stops.hit if stopped else ""))
        if final:
            self._forget(m.req_id, m.index)
        elif stopped:
            # free this choice's KV now rather than at max_tokens
            self.send("admission", Cancel(m.req_id, FinishReason.STOP, m.index))

    def _forget(self, req_id: str, index: int) -> None:
        choices = self.reqs.get(req_id)
        if choices is None:
            return
        ch = choices.get(index)
        if ch is not None:
            ch.done = ch.closed = True
        if all(c.closed for c in choices.values()):
            op = self.opens.get(req_id)
            if op is None or len(choices) >= op.n:
                self.reqs.pop(req_id, None)
                self.opens.pop(req_id, None)
