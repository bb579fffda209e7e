"""The one request pipeline every generation dialect runs through.

    body ─ dialect.parse ─> GenerateRequest ─ compile constraint ─ render + tokenize
         ─ sampling params ─ engine port (driver) ─ Deltas ─ dialect.renderer ─> JSON | SSE

`handler(dialect)` is the aiohttp handler of a generation route: the routes table
holds one line per dialect. A dialect only parses and renders
(`imp.http.pipeline.dialect`); each step between is written here once, in order:

1. read the body (a 400 for anything that is not a JSON object) and give every field its
   fate (`fates.sort`: a 400 for the reference's fields not implemented yet, the others
   the dialect does not take named in `imp-ignored-fields`, or a 400 under --strict-fields);
2. `dialect.parse` -> the typed request (`"dry_run": true` stops here with the
   capacity estimate, on the dialects that take it);
3. the request's grammar compiled under its deadline (a 400 before anything runs);
4. the prompt rendered and tokenized off the event loop, after a size check;
5. sampling defaults and the reply's token budget resolved (`resolve.sampling_params`);
6. the request registered as live (end_thinking finds it), submitted through the
   engine port, its Deltas rendered as they come: one JSON body, or SSE with the
   dialect's keep-alives while nothing comes and its error event if the engine
   fails after the stream started. Leaving early (the client went away) cancels the
   request upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import AsyncIterator

import msgspec
from aiohttp import web

from imp.http import keys
from imp.http.errors import ApiError, error_response
from imp.http.pipeline import fates, fields, resolve
from imp.http.pipeline.dialect import Dialect, Job, ParseContext, Renderer
from imp.http.pipeline.driver import StreamFault, generate
from imp.http.pipeline.estimate import estimate_for
from imp.http.pipeline.live import live_requests
from imp.http.pipeline.served import NotResident, Served, not_resident, served
from imp.http.pipeline.sse import sse_start, stream_failed
from imp.messages import Delta


def handler(dialect: Dialect):
    """The aiohttp handler of a dialect's generation route."""

    async def handle(request: web.Request) -> web.StreamResponse:
        headers = dialect.headers(request)
        try:
            resp = await run(request, dialect, headers)
        except ApiError as err:  # rendered here so the error carries the dialect's headers too
            resp = error_response(request, err, request["request_id"])
        if not resp.prepared:
            resp.headers.update(headers)
        return resp

    handle.__name__ = f"{dialect.endpoint}_handler"
    return handle


async def run(request: web.Request, dialect: Dialect, headers: dict[str, str]) -> web.StreamResponse:
    body = await fields.read_json(request)
    dry = dialect.dry_run and fields.boolean(body, "dry_run")
    try:  # models on demand: loaded first if need be (a dry run never loads one)
        async with served(request, body.get("model"), load=not dry) as model:
            return await _run(request, dialect, headers, body, model)
    except NotResident as nr:
        return web.json_response(await not_resident(request, nr.name))


async def _run(request: web.Request, dialect: Dialect, headers: dict[str, str], body: dict,
               model: Served) -> web.StreamResponse:
    (port, tm, grammars), cfg = model, request.app[keys.CONFIG]
    if "session_id" in dialect.fields:  # a proxy's affinity key is the body's session_id (the body's own wins)
        fields.session_header(body, request.headers)
    ignored = fates.sort(body, dialect.fields, strict=cfg.strict_fields, unknown_message=dialect.unknown_message)
    if ignored:  # named on the answer (whatever it is), logged once, counted with the request
        fates.say_once(ignored, dialect.endpoint, request.remote or "?")
        headers["imp-ignored-fields"] = fates.header(ignored)
    dry = dialect.dry_run and fields.boolean(body, "dry_run")
    req, extra = await dialect.parse(body, ParseContext(tm, port))
    if dry:  # the capacity estimate; nothing runs
        return web.json_response(await estimate_for(request, req, port, tm))
    resolve.check_sampling_table(req, port.card)
    await resolve.compile_constraint(req, grammars)
    resolve.check_size(req, tm, port.card)
    # on a worker thread: templating and tokenizing a large prompt never stall other streams
    prompt = await asyncio.to_thread(dialect.render_prompt, req, tm)
    if req.cache_breakpoint > -2:  # Anthropic cache_control: the marked prefix is kept warm after the request
        req = msgspec.structs.replace(req, pin_tokens=await _breakpoint_tokens(dialect, body, req, prompt.ids, tm,
                                                                                 port))
    shadow = resolve.guidance_messages(req)  # classifier-free guidance: the shadow sequence's prompt
    cfg_ids = tuple((await asyncio.to_thread(dialect.render_prompt, shadow, tm)).ids) if shadow is not None else ()
    params = resolve.sampling_params(req, len(prompt.ids), port.card, tm, cfg.max_tokens, cfg.max_output_tokens,
                                     await resolve.dry_params(req, prompt.ids, tm))
    rid = f"{dialect.id_prefix}{uuid.uuid4().hex[:24]}"
    client_id = request.get("client_request_id")
    request["response_id"] = client_id or rid
    job = Job(req=req, extra=extra, prompt=prompt, params=params, rid=rid, created=int(time.time()),
              card=port.card, text=tm, port=port, request_id=request["request_id"], path=request.path)
    out = dialect.renderer(job)
    with live_requests(request).track(rid, client_id, lambda: out.thinking):
        deltas = generate(port, rid, prompt.ids, params, req, request=request,
                          keepalive=req.stream and dialect.keepalive, ignored=ignored, cfg_prompt=cfg_ids)
        async with contextlib.aclosing(deltas):
            if req.stream:
                return await _stream(request, dialect, out, deltas, headers, rid)
            return await _complete(request, out, deltas, headers)


async def _breakpoint_tokens(dialect: Dialect, body: dict, req, ids, tm, port) -> int:
    """The prompt tokens through the last cache_control breakpoint: the whole prompt when it marks the last
    message; else the common prefix of this prompt and the one of the conversation cut after the marked message
    (for the tools or system prompt: with the first message's text replaced, so the two part where it starts)."""
    msgs, i = body.get("messages") or [], req.cache_breakpoint
    if i >= len(msgs) - 1:
        return len(ids)
    cut = dict(body, messages=msgs[:i + 1]) if i >= 0 else dict(body, messages=[{"role": "user", "content": "\u2063"}])
    try:
        other, _ = await dialect.parse(cut, ParseContext(tm, port))
        p = await asyncio.to_thread(dialect.render_prompt, other, tm)
    except ApiError:
        return 0  # the cut conversation does not render alone: nothing pinned beyond what the cache keeps anyway
    n = 0
    for a, b in zip(ids, p.ids):
        if a != b:
            break
        n += 1
    return n


async def _complete(request: web.Request, out: Renderer, deltas: AsyncIterator[Delta],
                    headers: dict[str, str]) -> web.Response:
    try:
        async for d in deltas:
            out.take(d)
    except StreamFault as exc:  # nothing was sent yet: a plain 500 with the fault's code
        raise ApiError(500, exc.message, code=exc.code) from None
    return web.json_response(await out.body(), headers={"X-Request-Id": request["response_id"], **headers})


async def _stream(request: web.Request, dialect: Dialect, out: Renderer, deltas: AsyncIterator[Delta | None],
                  headers: dict[str, str], rid: str) -> web.StreamResponse:
    """SSE. The response starts at the first item (a refusal before it is still an HTTP
    status); None items are the driver's keep-alive ticks."""
    resp = None
    try:
        async for d in deltas:
            chunk = b""
            if resp is None:
                resp = await sse_start(request, request["response_id"], **headers)
                chunk = out.start(d)
            chunk += out.keepalive() if d is None else out.delta(d)
            if chunk:
                await resp.write(chunk)
        tail = b""
        if resp is None:  # nothing at all came back (cannot normally happen)
            resp = await sse_start(request, request["response_id"], **headers)
            tail = out.start(None)
        await resp.write(tail + await out.end())
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, out.error, f"{dialect.endpoint} stream {rid}")
    return resp
