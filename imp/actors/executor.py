"""Executor actor (CPU, torch): runs one model step per StepPlan.

The model runs on a dedicated worker thread so the event loop keeps serving
HTTP while a step computes; torch releases the GIL inside its kernels. The
executor reads the clock (it is a shell, not a core): the time it puts into
StepResult is how time reaches the scheduler, and the log records it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from imp.actors.base import Actor, Bus
from imp.messages import Msg, StepFailed, StepPlan, StepResult


class ExecutorActor(Actor):
    name = "executor"

    def __init__(self, bus: Bus, runner, name: str = "executor"):
        self.name = name
        super().__init__(bus)
        self.runner = runner
        # one thread: torch's per-thread state (threads, grad mode) stays put
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self.steps = 0

    def _run_step(self, plan: StepPlan):
        import torch

        with torch.inference_mode():
            return self.runner.step(plan.seqs)

    async def on_message(self, sender: str, msg: Msg) -> None:
        if not isinstance(msg, StepPlan):
            return
        if msg.freed and hasattr(self.runner, "forget"):
            self.runner.forget(msg.freed)
        t0 = time.monotonic_ns()
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(self._pool, self._run_step, msg) if msg.seqs else []
        except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the server
            self.send("scheduler", StepFailed(msg.step, f"{type(exc).__name__}: {exc}", time.monotonic_ns()))
            return
        now = time.monotonic_ns()
        self.steps += 1
        self.send("scheduler", StepResult(msg.step, tokens, now, now - t0))

    async def on_stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
