"""HAProxy's agent-check on `--agent-port`: a TCP listener that writes one line and closes.

HAProxy connects every `agent-inter`, reads a line such as `up ready 70%` and sets the
backend's weight and administrative state from it (`imp.http.endpoints.readiness.agent_line` decides
the words; this file is only the socket). Anything HAProxy sends first is not read: the
protocol is "connect, read one line". An answer that cannot be computed (the engine gone)
is `down`, so a broken server is never kept in rotation by its own agent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger("imp.agent")


async def start_agent(host: str, port: int, answer: Callable[[], Awaitable[str]]) -> asyncio.AbstractServer:
    """Listen on host:port; each connection gets `await answer()` and is closed."""

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(answer(), 2.0)
        except Exception as exc:  # noqa: BLE001 - the agent must answer, whatever failed
            log.warning("agent-check: no answer (%s): saying down", exc)
            line = "down #no_answer\n"
        try:
            writer.write(line.encode("ascii", "replace"))
            await writer.drain()
        except OSError:  # the checker went away first: nothing to tell
            pass
        finally:
            writer.close()

    return await asyncio.start_server(one, host, port, reuse_address=True)


def engine_answer(port, fleet=None) -> Callable[[], Awaitable[str]]:
    """The agent's answer from an engine port (LocalEngine or, across processes, the same figures) and,
    with models on demand, the fleet's other resident models (imp.engine.fleet, in the same process)."""
    from imp.http.endpoints.readiness import agent_line

    async def answer() -> str:
        others = [p for p in fleet.ports() if p is not port] if fleet is not None else []
        snaps = [(await p.snapshot(), p.card) for p in others]
        return agent_line(await port.snapshot(), port.card, tuple(snaps))

    return answer
