"""The HTTP side's handle on the store: send a request, await its reply.

    client = StoreClient(lambda to, msg: ingress.send(to, msg), reply_to="ingress")
    # in IngressActor.on_message:  StoreReply -> client.deliver(msg)
    #                              Fault(actor="store") -> client.fail_all(msg.error)
    reply = await client.get("resp_123")
    if reply.ok: ... reply.response_json

Each call picks a fresh req_id, sends one message to the store actor and
awaits the future that `deliver` resolves when the `StoreReply` with that
req_id comes back to `reply_to`. Every call returns a StoreReply, never raises
for a store-side problem: a store that does not answer within timeout_s (or
whose actor died) gives ok=False with status UNAVAILABLE, so a handler maps
any outcome to an HTTP answer the same way. The wall clock for the age limit
is read here, in the shell, and travels in the message as now_s.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Callable, Sequence

import msgspec

from imp.messages import (
    Msg,
    StoreDelete,
    StoreGet,
    StoreGetChain,
    StoreItem,
    StoreListInputItems,
    StorePut,
    StoreReply,
    StoreStatus,
)
from imp.messages.store import failed


class StoreClient:
    def __init__(self, send: Callable[[str, Msg], None], reply_to: str = "ingress", store: str = "store",
                 timeout_s: float = 10.0, clock: Callable[[], float] = time.time, prefix: str = "st"):
        self.send = send  # (receiver, msg), e.g. the owning actor's bound send
        self.reply_to = reply_to
        self.store = store
        self.timeout_s = timeout_s
        self.clock = clock
        self.prefix = prefix
        self._ids = itertools.count(1)
        self.waiting: dict[str, asyncio.Future] = {}
        self.fault: str | None = None  # the store actor died: answer at once instead of timing out
        self.timeouts = 0

    # requests ------------------------------------------------------------
    async def put(self, response_id: str, response_json: bytes, input_items: Sequence[StoreItem] = (), *,
                  previous_response_id: str = "", created_at: float | None = None, model: str = "") -> StoreReply:
        now = self.clock()
        return await self._ask(lambda rid: StorePut(
            rid, self.reply_to, response_id, now if created_at is None else created_at, response_json,
            tuple(input_items), previous_response_id, model, now))

    async def get(self, response_id: str) -> StoreReply:
        return await self._ask(lambda rid: StoreGet(rid, self.reply_to, response_id, self.clock()))

    async def chain(self, response_id: str) -> StoreReply:
        """The conversation ending at response_id, oldest first (reply.chain; reply.missing)."""
        return await self._ask(lambda rid: StoreGetChain(rid, self.reply_to, response_id, self.clock()))

    async def delete(self, response_id: str) -> StoreReply:
        return await self._ask(lambda rid: StoreDelete(rid, self.reply_to, response_id))

    async def input_items(self, response_id: str, *, after: str = "", limit: int = 20,
                          order: str = "desc") -> StoreReply:
        return await self._ask(lambda rid: StoreListInputItems(
            rid, self.reply_to, response_id, after, limit, order, self.clock()))

    async def forward(self, msg: Msg) -> StoreReply:
        """A store request made elsewhere (an API-server process): asked under an id of
        ours, answered under its own."""
        reply = await self._ask(lambda rid: msgspec.structs.replace(msg, req_id=rid, reply_to=self.reply_to))
        return msgspec.structs.replace(reply, req_id=msg.req_id)

    # replies -------------------------------------------------------------
    def deliver(self, reply: StoreReply) -> bool:
        """Resolve the call waiting on reply.req_id; False if none (it timed out)."""
        fut = self.waiting.pop(reply.req_id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(reply)
        return True

    def fail_all(self, error: str) -> None:
        """The store actor died: every waiting call (and every later one) fails now."""
        self.fault = error
        for req_id, fut in list(self.waiting.items()):
            if not fut.done():
                fut.set_result(failed(req_id, StoreStatus.UNAVAILABLE, f"responses store unavailable: {error}"))
        self.waiting.clear()

    async def _ask(self, build: Callable[[str], Msg]) -> StoreReply:
        req_id = f"{self.prefix}-{next(self._ids)}"
        if self.fault is not None:
            return failed(req_id, StoreStatus.UNAVAILABLE, f"responses store unavailable: {self.fault}")
        fut = asyncio.get_running_loop().create_future()
        self.waiting[req_id] = fut
        self.send(self.store, build(req_id))
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            return failed(req_id, StoreStatus.UNAVAILABLE, f"responses store did not answer within {self.timeout_s:g}s")
        finally:
            self.waiting.pop(req_id, None)
