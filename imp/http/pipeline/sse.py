"""Server-sent events: the response's start, and a started stream that failed.

Every streaming dialect starts its response here (the headers every proxy and
client needs, set before the first byte) and ends a failed stream the same way:
the dialect only says how its error event is spelled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

from aiohttp import web

from imp.http.errors import ApiError
from imp.http.pipeline.driver import StreamFault

log = logging.getLogger("imp.http")


def sse_headers(request: web.Request, response_id: str, **extra: str) -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Request-Id": request.get("client_request_id") or response_id,
        "X-Accel-Buffering": "no",
        **extra,
    }


async def sse_start(request: web.Request, response_id: str, **extra: str) -> web.StreamResponse:
    # the middleware cannot add headers to a prepared response: set them all here
    resp = web.StreamResponse(headers=sse_headers(request, response_id, **extra))
    await resp.prepare(request)
    return resp


async def stream_failed(exc: Exception, resp: web.StreamResponse | None,
                        render: Callable[[str, str], bytes], what: str) -> None:
    """End a started stream that failed, in the dialect's own error event.

    Every dialect's stream ends the same way: an engine fault or our own bug
    becomes an error event (never a silent close), a client that went away
    needs nothing (generate()'s cleanup already cancelled the request), and a
    failure before the response started is re-raised for the middleware to
    answer with a status.
    """
    if resp is None:
        raise exc
    if isinstance(exc, ConnectionError):
        return
    if isinstance(exc, StreamFault):
        message, code = exc.message, exc.code
    elif isinstance(exc, ApiError):  # a refusal after a keep-alive had started the stream
        message, code = exc.message, exc.code or "invalid_request_error"
    else:
        log.exception("%s failed", what, exc_info=exc)
        message, code = f"internal error: {type(exc).__name__}", "internal_error"
    with contextlib.suppress(ConnectionError):
        await resp.write(render(message, code))
