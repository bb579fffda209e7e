"""The last second of a shutdown: the listener stays open until the balancer has stopped sending.

Why: after SIGTERM's drain the server used to close its listener at once. A balancer that had not
yet seen /ready turn 503 (HAProxy: two failed checks, ~2 s) still had requests on their way: a
connection accepted, or waiting in the backlog, with a request sent and then closed unanswered.
HAProxy may not resend such a request (it cannot know the server did not run it), and on a
reused client connection it closes the client's connection without a word, which the client
sees as "server disconnected" (HAProxy issues #2375, #3414: by design). A connection refused
is safe (never sent: retried elsewhere), and so is a 503 (deploy/haproxy.cfg resends it).

So once the drain is over, every request but the probes is answered 503 `draining` here, in
the HTTP layer (the engine may be gone: the process layout's Bye), and the listener closes only
when none has arrived for `quiet_s` (--shutdown-quiet), bounded by what is left of
--shutdown-timeout. A server nobody is calling closes at once.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from imp.http import keys
from imp.http.errors import ApiError


class Closing:
    """Per app: the time of the last request that was not a probe, and whether the gate is shut."""

    def __init__(self) -> None:
        self.shut = False
        self.last_arrival = float("-inf")  # time.monotonic() of the last non-probe request

    def arrived(self, now: float) -> None:
        self.last_arrival = now

    def quiet_for(self, now: float) -> float:
        return now - self.last_arrival


def closing_mw(is_probe):
    """Notes each request's arrival (probes aside: a balancer's checks never stop) and, once the
    gate is shut, answers it 503 draining in the dialect's shape."""

    @web.middleware
    async def mw(request: web.Request, handler):
        if is_probe(request):
            return await handler(request)
        gate: Closing = request.app[keys.CLOSING]
        gate.arrived(time.monotonic())
        if gate.shut:
            raise ApiError(503, "the server is shutting down; send the request to another replica",
                           code="draining", headers={"Retry-After": "1"})
        return await handler(request)

    return mw


async def close_when_quiet(app: web.Application, quiet_s: float, limit_s: float, poll_s: float = 0.05) -> float:
    """Shut the gate, then return once no request has arrived for quiet_s (or after limit_s).
    How long it waited."""
    gate: Closing = app[keys.CLOSING]
    gate.shut = True
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and gate.quiet_for(time.monotonic()) < quiet_s:
        await asyncio.sleep(poll_s)
    return time.monotonic() - t0
