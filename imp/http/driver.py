"""The per-token driver every generation dialect shares.

`generate` submits a request and yields its Deltas as they arrive; a refusal
before the first delta becomes an ApiError (so the handler can still answer
with a proper status), a fault after it becomes an `error` item the dialect
renders as its own error event. Leaving the iterator early (client gone,
handler cancelled) cancels the request upstream, so its KV is freed within a
step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Callable

from aiohttp import web

from imp.http.errors import ApiError
from imp.messages import Delta, Fault, FinishReason, Reject, RequestStats


log = logging.getLogger("imp.http")


class StreamFault(Exception):
    """The engine failed after the response had started."""


async def generate(engine, req_id: str, prompt: list[int], gen, *, endpoint: str,
                   salt: str = "") -> AsyncIterator[Delta]:
    if engine.fault:
        raise ApiError(503, f"engine unavailable: {engine.fault}", code="engine_faulted")
    ingress = engine.ingress
    handle = ingress.submit(
        req_id, prompt, gen.params, n=gen.n, priority=gen.priority, stop=gen.stop, salt=salt,
        prompt_tail=prompt[-4:], cache_prompt=gen.cache_prompt, session_id=gen.session_id,
    )
    started = False
    stats = {"prompt": len(prompt), "completion": [0] * gen.n, "cached": 0, "finish": ""}
    status = 200
    try:
        while not (handle.done and handle.queue.empty()):
            item = await handle.queue.get()
            if isinstance(item, Reject):
                status = item.status
                headers = {"Retry-After": str(max(1, round(item.retry_after_s)))} if item.status == 429 else None
                raise ApiError(item.status, item.message, code=item.code, headers=headers)
            if isinstance(item, Fault):
                status = 500
                if not started:
                    raise ApiError(500, f"engine fault: {item.error}", code="engine_faulted")
                raise StreamFault(item.error)
            if item.error and item.finish == FinishReason.ERROR:
                status = 500
                if not started:
                    raise ApiError(500, f"engine step failed: {item.error}", code="engine_step_failed")
                raise StreamFault(item.error)
            started = True
            stats["prompt"] = item.prompt_tokens or stats["prompt"]
            stats["cached"] = item.cached_tokens
            stats["completion"][item.index] = item.completion_tokens
            if item.finish != FinishReason.NONE:
                stats["finish"] = item.finish.openai()
            yield item
    finally:
        if handle.done:
            ingress.release(req_id)
        else:
            ingress.cancel(req_id)  # client gone or handler failed: free the KV now
        now = time.monotonic()
        ingress.stats(
            RequestStats(
                endpoint, status, stats["prompt"], sum(stats["completion"]), stats["cached"], 0.0,
                (handle.first_token_at - handle.arrival) if handle.first_token_at else 0.0,
                now - handle.arrival, stats["finish"], handle.itl[-256:],
            )
        )


async def sse_end(request: web.Request, resp: web.StreamResponse | None, usage_chunk: bytes | None
                  ) -> web.StreamResponse:
    """Close an OpenAI-dialect stream: the usage chunk when asked for, then [DONE]
    (a stream that got no delta at all is started first)."""
    if resp is None:
        resp = await sse_start(request, request["response_id"])
    if usage_chunk is not None:
        await resp.write(usage_chunk)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def sse_start(request: web.Request, response_id: str) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": request.get("client_request_id") or response_id,
            "X-Accel-Buffering": "no",
        }
    )
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
        message, code = f"engine fault: {exc}", "engine_faulted"
    else:
        log.exception("%s failed", what, exc_info=exc)
        message, code = f"internal error: {type(exc).__name__}", "internal_error"
    with contextlib.suppress(ConnectionError):
        await resp.write(render(message, code))
