"""Clock actor: the only source of time for the cores, as Tick messages."""

from __future__ import annotations

import asyncio
import time

from imp.actors.base import Actor, Bus
from imp.messages import Msg, Tick


class ClockActor(Actor):
    name = "clock"

    def __init__(self, bus: Bus, period_s: float = 0.25, to: str | list[str] = "scheduler"):
        super().__init__(bus)
        self.period_s = period_s
        self.to = [to] if isinstance(to, str) else list(to)  # every scheduler replica
        self._ticker: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic_ns()
            for to in self.to:
                self.send(to, Tick(now))

    async def on_message(self, sender: str, msg: Msg) -> None:
        pass

    async def on_stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
