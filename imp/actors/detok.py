"""Detokenizer actor: a step's tokens fanned out to ingress as token-id Deltas (the decode lane's as they came, one
TokenRows).

Text is not made here: the engine port's stream renders it where it is sent
(`imp.engine.render.RenderedStream`), in whichever process runs the HTTP side, so
stop strings and the incremental detokenizer live in one place whatever the process
layout. `DetokOpen` / `DetokClose` still arrive (they are on the event log: a request's
stop strings and prompt tail, as it was opened) and need nothing here.
"""

from __future__ import annotations

from imp.actors.base import Actor, Bus
from imp.messages import Delta, DeltaBatch, Msg, TokenBatch, TokenOut


class DetokActor(Actor):
    name = "detok"

    def __init__(self, bus: Bus):
        super().__init__(bus)

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, TokenBatch):
            ds = tuple([Delta(t, "", t.finish) for t in msg.outs])
            self.send("ingress", DeltaBatch(ds) if msg.rows is None else DeltaBatch(ds, msg.rows, msg.rows_at))
        elif isinstance(msg, TokenOut):
            self.send("ingress", Delta(msg, "", msg.finish))
