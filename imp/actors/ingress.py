"""Ingress actor: the engine's side of the HTTP front door.

HTTP handlers call `submit` / `cancel`; the actor routes what comes back
(Delta, Reject, Fault; a decode lane row's plain token as a (choice index, token id)
tuple) to the request's own queue. The handles table is the
ingress actor's state and nobody else's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from imp.actors.base import Actor, Bus
from imp.actors.channel import Channel
from imp.actors.store_client import StoreClient
from imp.messages import (
    Cancel,
    Delta,
    DeltaBatch,
    DetokClose,
    DetokOpen,
    EndThinking,
    LoraState,
    MemoryState,
    Fault,
    FinishReason,
    Msg,
    Reject,
    RequestStats,
    Resume,
    SamplingParams,
    SessionClose,
    StoreReply,
    Submit,
    Suspend,
    TokenRows,
)


@dataclass
class RequestHandle:
    req_id: str
    n: int
    queue: Channel = field(default_factory=Channel)  # one reader: the request's stream
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    itl: list[float] = field(default_factory=list)
    finished: set = field(default_factory=set)  # choice indexes that ended
    prompt_tokens: int = 0
    max_tokens: int = 0
    generated: int = 0  # tokens delivered so far, all choices
    speculative: bool = False  # a drafter runs for it (params.speculative)
    spec: list = field(default_factory=lambda: [0, 0, 0])  # verify rounds, draft tokens fed, kept: all choices
    cache: tuple | None = None  # (tier, warm tokens) of the prefix cache on arrival (None: not asked)

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n


class IngressActor(Actor):
    name = "ingress"

    def __init__(self, bus: Bus, store: bool = False):
        """store: a store actor runs; ingress holds its client and routes its replies to it."""
        super().__init__(bus)
        self.store = StoreClient(self.send, reply_to=self.name) if store else None
        self.handles: dict[str, RequestHandle] = {}
        self.fault: str | None = None
        self.suspended = False  # POST /admin/suspend; admission refuses while set
        self.rejections = 0  # Rejects of admission/scheduler, any status
        self.last_reject_reason: str | None = None
        self.memory: dict = {}  # executor -> its latest MemoryState (suspend / reload)
        self.lora_states: dict = {}  # (executor, adapter id) -> its LoraState
        self.memory_changed = asyncio.Event()  # a MemoryState or LoraState arrived

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
        cfg_prompt: tuple[int, ...] = (),
        pin_tokens: int = 0,
        cache: tuple[str, int] | None = None,
    ) -> RequestHandle:
        if req_id in self.handles:
            raise ValueError(f"duplicate request id {req_id}")
        h = self.handles[req_id] = RequestHandle(req_id, n, prompt_tokens=len(prompt),
                                                 max_tokens=params.max_tokens, speculative=params.speculative)
        h.cache = cache  # (tier, warm tokens) as the prefix cache stood on arrival
        self.send("detok", DetokOpen(req_id, n, tuple(stop or ()), True, tuple(prompt_tail or ())))
        self.send(
            "admission",
            Submit(req_id, tuple(prompt), params, time.monotonic_ns(), n, priority, salt,
                   cache_prompt, session_id, tuple(cfg_prompt), pin_tokens),
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
        self.send("admission", EndThinking(req_id, tuple(token_ids)))  # after its Submit: FIFO
        return True

    def close_session(self, session_id: str) -> None:
        """Unpin a session's prompt now (else it expires after the session TTL)."""
        self.send("admission", SessionClose(session_id))

    def suspend(self, reason: str = "operator") -> None:
        """Close admission (new requests get 503 `suspended`, or `draining` on shutdown);
        running ones finish."""
        self.suspended = reason != "draining"
        self.send("admission", Suspend(reason))

    def resume(self) -> None:
        self.suspended = False
        self.send("admission", Resume())

    def live_rows(self, now: float, waiting: int) -> list[dict]:
        """One row per live request, queued rows first (GET /v1/metrics).

        Ingress sees no scheduler state, so `queued` vs `prefill` is inferred:
        of the requests without a token yet, the `waiting` newest are queued.
        """
        hs = sorted(self.handles.values(), key=lambda h: h.arrival)
        fresh = [h for h in hs if not h.first_token_at]
        queued = {id(h) for h in fresh[max(0, len(fresh) - waiting):]} if waiting > 0 else set()
        rows = []
        for h in hs:
            ttft = h.first_token_at - h.arrival if h.first_token_at else None
            dec = h.last_token_at - h.first_token_at if h.first_token_at else 0.0
            rows.append({
                "id": h.req_id,
                "state": "decode" if h.first_token_at else ("queued" if id(h) in queued else "prefill"),
                "prompt_tokens": h.prompt_tokens,
                "generated": h.generated,
                "max_tokens": h.max_tokens,
                "n": h.n,
                "elapsed_s": round(now - h.arrival, 3),
                "ttft_s": None if ttft is None else round(ttft, 3),
                "decode_tok_s": round((h.generated - h.n) / dec, 1) if dec > 0 and h.generated > h.n else None,
                "speculative": {"rounds": h.spec[0], "drafted": h.spec[1], "accepted": h.spec[2],
                                "accept_rate": round(h.spec[2] / h.spec[1], 3) if h.spec[1] else None}
                if h.speculative else None,
                "cache": {"tier": h.cache[0], "warm_tokens": h.cache[1]} if h.cache is not None else None,
            })
        order = {"queued": 0, "prefill": 1, "decode": 2}
        rows.sort(key=lambda r: order[r["state"]])  # stable: by arrival within a state
        return rows

    def release(self, req_id: str) -> None:
        """The handler is done with a request that ran to its end."""
        self.handles.pop(req_id, None)

    def stats(self, msg: RequestStats) -> None:
        self.send("metrics", msg)

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, DeltaBatch):
            now = time.monotonic()
            ds, rows = msg.deltas, msg.rows
            if rows is None:
                for d in ds:
                    self._deliver(d, now)
            else:
                for d in ds[:msg.rows_at]:
                    self._deliver(d, now)
                self._deliver_rows(rows, now)
                for d in ds[msg.rows_at:]:
                    self._deliver(d, now)
        elif isinstance(msg, Delta):
            self._deliver(msg, time.monotonic())
        elif isinstance(msg, Reject):
            self.rejections += 1
            self.last_reject_reason = msg.code
            self.send("detok", DetokClose(msg.req_id))
            h = self.handles.get(msg.req_id)
            if h is not None:
                h.finished.update(range(h.n))
                h.queue.put_nowait(msg)
        elif isinstance(msg, MemoryState):
            self.memory[msg.actor] = msg
            self.memory_changed.set()
        elif isinstance(msg, LoraState):
            self.lora_states[(msg.actor, msg.lora_id)] = msg
            self.memory_changed.set()
        elif isinstance(msg, StoreReply):
            if self.store is not None:
                self.store.deliver(msg)
        elif isinstance(msg, Fault):
            if msg.actor == "store":  # the store's calls fail; generation goes on
                if self.store is not None:
                    self.store.fail_all(msg.error)
                return
            self.fault = msg.error
            for h in list(self.handles.values()):
                h.queue.put_nowait(msg)

    def _deliver_rows(self, rows: TokenRows, now: float) -> None:
        """The decode lane's plain tokens: each to its request's queue as (choice index, token id), the
        bookkeeping `_deliver` does for a one-token Delta without a finish."""
        handles = self.handles
        for rid, i, t in rows.rows():
            h = handles.get(rid)
            if h is None:
                continue  # handler gone (cancelled); the scheduler was told
            h.generated += 1
            if h.first_token_at == 0.0:
                h.first_token_at = now
            elif i == 0:
                h.itl.append(now - h.last_token_at)
            if i == 0:
                h.last_token_at = now
            h.queue.put_nowait((i, t))

    def _deliver(self, msg: Delta, now: float) -> None:
        o = msg.out  # (its fields read once: a Delta's are properties through it, every token of every stream)
        h = self.handles.get(o.req_id)
        if h is None:
            return  # handler gone (cancelled); the scheduler was told
        if o.spec_verify_steps:  # the verifies since this choice's last TokenOut
            sp = h.spec
            sp[0], sp[1], sp[2] = sp[0] + o.spec_verify_steps, sp[1] + o.spec_drafted, sp[2] + o.spec_accepted
        if o.token_ids:
            h.generated += len(o.token_ids)
            if h.first_token_at == 0.0:
                h.first_token_at = now
            elif o.index == 0:
                h.itl.append(now - h.last_token_at)
            if o.index == 0:
                h.last_token_at = now
        if msg.finish != FinishReason.NONE:
            h.finished.add(o.index)
        h.queue.put_nowait(msg)
