"""A FIFO with one consumer: what an actor's inbox and a request's stream need of asyncio.Queue, at a fraction of
its cost a message.

At 256 streams every step puts one item on each stream's queue and wakes its reader; asyncio.Queue's put_nowait
also counts unfinished tasks and clears an Event (for `join`, which nothing here uses) and its get walks a deque of
getters: ~15 % of the engine's host time a token under cProfile (bench/engine.py --profile 256). Here a put is an
append and, only when the consumer sleeps, one future's result; a get that finds an item returns it without a
future. One consumer at a time (an actor's loop, a stream's renderer): a second concurrent `get` is a bug and
raises.
"""

from __future__ import annotations

import asyncio
import collections


class Channel:
    __slots__ = ("_queue", "_waiter")

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None  # the consumer's, while it sleeps on an empty channel

    def put_nowait(self, item) -> None:
        self._queue.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():  # (cancelled: its consumer is gone; the item waits for the next get)
                w.set_result(None)

    async def get(self):
        q = self._queue
        while not q:
            if self._waiter is not None:
                raise RuntimeError("Channel: a second consumer")
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                if self._waiter is w:  # cancelled while waiting: the next get may wait again
                    self._waiter = None
        return q.popleft()

    def get_nowait(self):
        if not self._queue:
            raise asyncio.QueueEmpty
        return self._queue.popleft()

    def peek(self):
        """The next item, left in place (IndexError when empty)."""
        return self._queue[0]

    def empty(self) -> bool:
        return not self._queue

    def qsize(self) -> int:
        return len(self._queue)
