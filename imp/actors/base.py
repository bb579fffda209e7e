"""Actor runtime: a bus of inboxes (imp.actors.channel) that logs every delivery.

Each actor owns one inbox (FIFO) and its state; actors share nothing but
messages. `Bus.send` is the only way a message moves, so the event log sees
all of them, in the order the receivers will process them.

Lifecycle (pykka-style): on_start, on_message, on_stop, on_failure. A failed
actor reports a `Fault` to ingress and metrics, so callers waiting on it get
an error instead of hanging; messages sent to a dead actor are dropped (and
logged) rather than piling up.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

from imp.actors.channel import Channel
from imp.core.core import Core
from imp.log.eventlog import Envelope, EventLog
from imp.messages import Fault, Msg, StepPlan

log = logging.getLogger("imp.actors")

_STOP = object()


class Bus:
    def __init__(self, eventlog: EventLog):
        self.log = eventlog
        self.inboxes: dict[str, Channel] = {}
        self.dead: dict[str, str] = {}  # actor -> error
        self.seq = 0
        self.step = 0

    def register(self, name: str) -> Channel:
        assert name not in self.inboxes, f"actor {name!r} registered twice"
        q = Channel()  # one consumer: the actor's own loop
        self.inboxes[name] = q
        return q

    def send(self, sender: str, receiver: str, msg: Msg) -> None:
        if type(msg) is StepPlan:
            self.step = msg.step
        self.seq += 1
        self.log.append(Envelope(self.seq, sender, receiver, self.step, time.time_ns(), msg))
        q = self.inboxes.get(receiver)
        if q is None or receiver in self.dead:
            log.debug("dropped %s -> %s: %s", sender, receiver, type(msg).__name__)
            return
        q.put_nowait((sender, msg))


class Actor:
    """Base actor: a task that drains its inbox one message at a time."""

    name = "actor"

    def __init__(self, bus: Bus):
        self.bus = bus
        self.inbox = bus.register(self.name)
        self.task: asyncio.Task | None = None

    def send(self, receiver: str, msg: Msg) -> None:
        self.bus.send(self.name, receiver, msg)

    # lifecycle hooks ---------------------------------------------------
    async def on_start(self) -> None:
        pass

    async def on_stop(self) -> None:
        pass

    async def on_message(self, sender: str, msg: Msg) -> None:
        raise NotImplementedError

    async def on_failure(self, exc: BaseException) -> None:
        err = f"{self.name} failed: {type(exc).__name__}: {exc}"
        log.error("%s\n%s", err, "".join(traceback.format_exception(exc)))
        self.bus.dead[self.name] = err
        for r in ("ingress", "metrics"):
            if r != self.name:
                self.send(r, Fault(self.name, err))

    # runtime -----------------------------------------------------------
    def start(self) -> asyncio.Task:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        return self.task

    async def _run(self) -> None:
        try:
            await self.on_start()
            while True:
                sender, msg = await self.inbox.get()
                if msg is _STOP:
                    break
                await self.on_message(sender, msg)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - an actor must report, not vanish
            await self.on_failure(exc)
        finally:
            await self.on_stop()

    async def stop(self) -> None:
        if self.task is None or self.task.done():
            return
        self.inbox.put_nowait(("", _STOP))
        try:
            await asyncio.wait_for(self.task, 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.task.cancel()


class CoreActor(Actor):
    """Shell around a pure core: deliver, collect outputs, send them on."""

    def __init__(self, bus: Bus, core: Core):
        self.name = core.name
        self.core = core
        super().__init__(bus)

    async def on_message(self, sender: str, msg: Msg) -> None:
        for receiver, out in self.core.handle(sender, msg):
            self.send(receiver, out)
