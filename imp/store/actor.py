"""The store actor: a thin shell between the bus and the writer thread.

`on_message` only queues the request for the writer (worker.py) and returns,
so no SQLite call ever runs on the event loop; the writer hands each batch's
replies back with `call_soon_threadsafe`, and they go out on the bus (and into
the event log) from the loop thread, to the `reply_to` each request named.

Boot: `open_store(config)` first (it raises StoreOpenError before anything is
served), then `StoreActor(bus, store)`. Stop: every request already in the
inbox or the writer's queue is answered and committed before the file closes.

The counters below are the committed figures, for the metrics actor to read.
"""

from __future__ import annotations

import asyncio
import logging
from operator import attrgetter

from imp.actors.base import Actor, Bus
from imp.messages import Msg
from imp.store.messages import STORE_MESSAGES, StoreReply
from imp.store.sqlite import StoreDB
from imp.store.worker import Replies, Worker

log = logging.getLogger("imp.store")


class StoreActor(Actor):
    name = "store"

    def __init__(self, bus: Bus, store: StoreDB):
        super().__init__(bus)
        self.store = store
        self.worker = Worker(store, self._from_writer)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.worker.start()

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, STORE_MESSAGES) and not isinstance(msg, StoreReply):
            self.worker.submit(msg)
        else:
            log.warning("store: ignored %s from %s", type(msg).__name__, sender)

    async def on_stop(self) -> None:
        await asyncio.to_thread(self.worker.close)
        await asyncio.sleep(0)  # let the last batch's replies (already scheduled) go out

    # writer thread -> loop ------------------------------------------------
    def _from_writer(self, replies: Replies) -> None:
        try:
            self._loop.call_soon_threadsafe(self._send_replies, replies)
        except RuntimeError:  # the loop is closed: the process is ending and nobody awaits them
            pass

    def _send_replies(self, replies: Replies) -> None:
        for to, reply in replies:
            self.send(to, reply)

    # figures for metrics ----------------------------------------------
    rows = property(attrgetter("store.stats.rows"))
    bytes = property(attrgetter("store.stats.bytes"))
    evicted_count = property(attrgetter("store.stats.evicted_count"))
    evicted_bytes = property(attrgetter("store.stats.evicted_bytes"))
    evicted_age = property(attrgetter("store.stats.evicted_age"))
    write_failures = property(attrgetter("store.stats.write_failures"))

    @property
    def queued(self) -> int:
        """Requests the writer has not taken yet (a growing figure means a slow disk)."""
        return self.worker.q.qsize()

    def figures(self) -> dict[str, int]:
        """Every counter (Stats fields: rows, bytes, evicted_*, deleted, *_failures) and the queue."""
        return {**self.store.stats.snapshot(), "queued": self.queued}
