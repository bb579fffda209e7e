"""The per-token driver: one request through the engine port, its Deltas as they arrive.

`generate` submits a resolved request through the engine port and yields
its Deltas as they arrive; a refusal before the first delta becomes an
ApiError (so the handler can still answer with a proper status), a fault
after it a `StreamFault` the dialect renders as its own error event. Leaving
the iterator early (client gone, handler cancelled) cancels the request
upstream, so its KV is freed within a step. Every request's figures go to
the metrics actor when it ends, whatever the dialect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import msgspec
from aiohttp import web

from imp.engine.port import EnginePort, LoraRefused, Submission
from imp.http.pipeline.spec_usage import SpecTally
from imp.http.errors import ApiError
from imp.http.pipeline import fates
from imp.http.pipeline.request import GenerateRequest
from imp.messages import Delta, Fault, FinishReason, Reject, RequestStats, SamplingParams

log = logging.getLogger("imp.http")


class StreamFault(Exception):
    """The engine failed after the response had started: `engine_faulted` (the engine is gone or its device
    poisoned: nothing more is served) or `engine_step_failed` (one step failed on the host; the engine goes on).
    A stream ends in the dialect's error event with it, a whole answer is a 500 with it."""

    def __init__(self, error: str, code: str = "engine_faulted"):
        super().__init__(error)
        self.code = code

    @property
    def message(self) -> str:
        return f"{'engine fault' if self.code == 'engine_faulted' else 'engine step failed'}: {self}"


def finish_label(reason: FinishReason) -> str:
    """A finish reason as OpenAI spells it (a timeout reads as "length", as the reference says)."""
    if reason in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return "length"
    if reason in (FinishReason.STOP, FinishReason.NONE):
        return "stop"
    return reason.name.lower()


# A stream that has nothing to send (queued, or prefilling a long prompt: 20k tokens is minutes
# on a CPU) still shows it is alive: agent clients hang up after a silence (Claude Code and
# Codex after 300 s without an event). The first keep-alive comes late enough that a refusal
# (admission answers in milliseconds) is still an HTTP status, then one every few seconds.
KEEPALIVE_FIRST_S = 2.0
KEEPALIVE_EVERY_S = 10.0


async def _with_keepalive(stream: AsyncIterator, first_s: float, every_s: float) -> AsyncIterator:
    """The stream's items, with a None wherever it was silent first_s (then every_s) seconds."""
    it = stream.__aiter__()
    pending: asyncio.Future | None = None
    timeout = first_s
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait((pending,), timeout=timeout)
            if not done:
                timeout = every_s
                yield None
                continue
            fut, pending = pending, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            timeout = every_s
            yield item
    finally:
        if pending is not None:  # left while waiting: stop the read before the stream is closed
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending


def with_lora(port: EnginePort, req: GenerateRequest, params: SamplingParams, salt: str):
    """The adapter the request runs with: its `lora` field, else a `model` that names a loaded
    adapter (as vLLM serves them); its id goes into the params and the prefix-cache salt
    (different adapters never share KV)."""
    name = req.lora or (req.model if req.model and port.lora_named(req.model) is not None else "")
    if not name:
        return params, salt
    lid = port.lora_named(name)
    if lid is None:
        loaded = ", ".join(repr(a.name) for a in port.loras()) or "none"
        raise ApiError(400, f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); POST /admin/lora/load",
                       code="lora_not_loaded", param="lora")
    return msgspec.structs.replace(params, lora=lid), f"lora:{lid}|{salt}"


async def generate(port: EnginePort, req_id: str, prompt: list[int], params: SamplingParams,
                   req: GenerateRequest, *, salt: str = "", request: web.Request | None = None,
                   keepalive: bool = False, ignored: tuple[str, ...] = (),
                   cfg_prompt: tuple[int, ...] = ()) -> AsyncIterator[Delta | None]:
    """request: the HTTP request (its client id and W3C traceparent go into the request's
    figures, for the trace and the request log). keepalive: yield None after a silence
    (KEEPALIVE_*), for a streaming dialect to write its own keep-alive; a refusal that comes
    after one had started the response is still an ApiError, which `stream_failed` renders as
    the dialect's error event."""
    if port.fault:
        # the reference: every request after a device fault is a 500 engine_faulted, never queued
        raise ApiError(500, f"engine fault: {port.fault}", code="engine_faulted")
    params, salt = with_lora(port, req, params, salt)
    try:
        stream = port.submit(Submission(
            req_id=req_id, prompt=tuple(prompt), params=params, n=req.n, priority=req.priority, stop=req.stop,
            salt=salt, cache_prompt=req.cache_prompt, session_id=req.session_id, cfg_prompt=tuple(cfg_prompt),
            pin_tokens=req.pin_tokens,
        ))
    except LoraRefused as exc:  # unloaded between the name check and the submit
        raise ApiError(exc.status, exc.message, code=exc.code, param="lora") from None
    arrival = time.monotonic()
    arrival_ns = time.time_ns()  # wall clock for the trace; the monotonic one for the latencies
    first_ns = 0
    reject_code = ""
    first = last = 0.0
    itl: list[float] = []
    started = False
    completion = [0] * req.n
    prompt_tokens, cached, finish, status = len(prompt), 0, "", 200
    finishes = [""] * req.n
    spec = SpecTally()
    items = _with_keepalive(stream, KEEPALIVE_FIRST_S, KEEPALIVE_EVERY_S) if keepalive else stream
    try:
        async for item in items:
            if item is None:
                yield None
                continue
            if isinstance(item, Reject):
                status, reject_code = item.status, item.code
                headers = {"Retry-After": str(max(1, round(item.retry_after_s)))} if item.status == 429 else None
                raise ApiError(item.status, item.message, code=item.code, headers=headers)
            if isinstance(item, Fault):
                status = 500
                fault = StreamFault(item.error, "engine_faulted")
                if not started:
                    raise ApiError(500, fault.message, code=fault.code)
                raise fault
            if item.error and item.finish == FinishReason.ERROR:
                status = 500
                fault = StreamFault(item.error, "engine_step_failed")
                if not started:
                    raise ApiError(500, fault.message, code=fault.code)
                raise fault
            started = True
            if item.token_ids:
                now = time.monotonic()
                if not first:
                    first, first_ns = now, time.time_ns()
                elif item.index == 0:
                    itl.append(now - last)
                if item.index == 0:
                    last = now
            prompt_tokens = item.prompt_tokens or prompt_tokens
            cached = item.cached_tokens or cached
            completion[item.index] = item.completion_tokens
            spec.take(item)
            if item.finish != FinishReason.NONE:
                finish = finish_label(item.finish)
                finishes[item.index] = finish
            yield item
    finally:
        if items is not stream:
            await items.aclose()
        await stream.aclose()  # before the end: cancels upstream
        now = time.monotonic()
        hdrs = request.headers if request is not None else {}
        port.report(RequestStats(
            req.endpoint, status, prompt_tokens, sum(completion), cached, 0.0,
            (first - arrival) if first else 0.0, now - arrival, finish, tuple(itl[-256:]),
            request_id=req_id, client_request_id=(request.get("client_request_id") or "") if request is not None else "",
            model=port.card.name, stream=req.stream, traceparent=hdrs.get("traceparent", "")[:128],
            arrival_unix_ns=arrival_ns, first_token_unix_ns=first_ns, end_unix_ns=time.time_ns(),
            finish_reasons=tuple(f for f in finishes if f), reject_code=reject_code,
            ignored_fields=tuple(fates.label(n) for n in ignored),
            spec_drafted=spec.drafted, spec_accepted=spec.accepted, spec_verify_steps=spec.verifies,
        ))
