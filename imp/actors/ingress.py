"""Ingress actor: the engine's side of the HTTP front door.

HTTP handlers call `submit` / `cancel`; the actor routes what comes back
(Delta, Reject, Fault) to the request's own queue. The handles table is the
ingress actor's state and nobody else's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from imp.actors.base import Actor, Bus
from imp.messages import (
    Cancel,
    Delta,
    DeltaBatch,
    DetokClose,
    DetokOpen,
    EndThinking,
    Fault,
    FinishReason,
    Msg,
    Reject,
    RequestStats,
    SamplingParams,
    SessionClose,
    Submit,
)


@dataclass
class RequestHandle:
    req_id: str
    n: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    itl: list[float] = field(default_factory=list)
    finished: set = field(default_factory=set)  # choice indexes that ended

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n


class IngressActor(Actor):
    name = "ingress"

    def __init__(self, bus: Bus):
        super().__init__(bus)
        self.handles: dict[str, RequestHandle] = {}
        self.fault: str | None = None

    def submit(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        priority: int = 0,
        stop: list[str] | None = None,
        salt: str = "",
        prompt_tail: list[int] | None = None,
        cache_prompt: bool = False,
        session_id: str = "",
    ) -> RequestHandle:
        if req_id in self.handles:
            raise ValueError(f"duplicate request id {req_id}")
        h = self.handles[req_id] = RequestHandle(req_id, n)
        self.send("detok", DetokOpen(req_id, n, list(stop or []), True, list(prompt_tail or [])))
        self.send(
            "admission",
            Submit(req_id, list(prompt), params, time.monotonic_ns(), n, priority, salt,
                   cache_prompt, session_id),
        )
        return h

    def cancel(self, req_id: str) -> None:
        """The client went away (or the handler ended early): stop work now."""
        h = self.handles.pop(req_id, None)
        if h is not None and not h.done:
            self.send("admission", Cancel(req_id, FinishReason.CANCELLED))

    def end_thinking(self, req_id: str, token_ids: list[int]) -> bool:
        """Force the think block of a live request closed; False if it is not live."""
        h = self.handles.get(req_id)
        if h is None or h.done:
            return False
        self.send("admission", EndThinking(req_id, list(token_ids)))  # after its Submit: FIFO
        return True

    def close_session(self, session_id: str) -> None:
        """Unpin a session's prompt now (else it expires after the session TTL)."""
        self.send("admission", SessionClose(session_id))

    def release(self, req_id: str) -> None:
        """The handler is done with a request that ran to its end."""
        self.handles.pop(req_id, None)

    def stats(self, msg: RequestStats) -> None:
        self.send("metrics", msg)

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, DeltaBatch):
            now = time.monotonic()
            for d in msg.deltas:
                self._deliver(d, now)
        elif isinstance(msg, Delta):
            self._deliver(msg, time.monotonic())
        elif isinstance(msg, Reject):
            self.send("detok", DetokClose(msg.req_id))
            h = self.handles.get(msg.req_id)
            if h is not None:
                h.finished.update(range(h.n))
                h.queue.put_nowait(msg)
        elif isinstance(msg, Fault):
            self.fault = msg.error
            for h in list(self.handles.values()):
                h.queue.put_nowait(msg)

    def _deliver(self, msg: Delta, now: float) -> None:
        h = self.handles.get(msg.req_id)
        if h is None:
            return  # handler gone (cancelled); the scheduler was told
        if msg.token_ids:
            if h.first_token_at == 0.0:
                h.first_token_at = now
            elif msg.index == 0:
                h.itl.append(now - h.last_token_at)
            if msg.index == 0:
                h.last_token_at = now
        if msg.finish != FinishReason.NONE:
            h.finished.add(msg.index)
        h.queue.put_nowait(msg)
