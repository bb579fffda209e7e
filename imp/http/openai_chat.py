"""POST /v1/chat/completions — the OpenAI chat dialect: parse, run, render."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

from aiohttp import web

from imp.http import body as B
from imp.http import keys, resolve
from imp.http.capacity import estimate_for
from imp.http.chat_request import parse
from imp.http.control import live_requests
from imp.http.driver import KEEPALIVE_COMMENT, StreamFault, finish_label, generate, sse_start, stream_failed
from imp.http.errors import ApiError
from imp.http.logprobs import chat_content
from imp.http.openai_wire import error_event, fingerprint, sse_data, sse_end, usage_json
from imp.http.reasoning import ThinkSplitter, split_delta
from imp.http.request import GenerateRequest
from imp.messages import FinishReason
from imp.tools import ArgsDelta, CallStart, Text

log = logging.getLogger("imp.http")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    port, tm, cfg = request.app[keys.PORT], request.app[keys.TEXT], request.app[keys.CONFIG]
    body = await B.read_json(request)
    if B.boolean(body, "dry_run"):  # POST /v1/estimate's answer; nothing runs
        return web.json_response(await estimate_for(request, body))
    req = parse(body, tm.tokenizer.vocab_size, tm.template.source)
    await resolve.compile_constraint(req, request.app[keys.GRAMMARS])
    prompt = await resolve.render_off_loop(req, tm, port.card)
    params = resolve.sampling_params(req, len(prompt.ids), port.card, tm, cfg.max_tokens, cfg.max_output_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or rid
    ctx = _Ctx(port, tm, req, rid, len(prompt.ids))
    splitters = [ThinkSplitter(prompt.opens_think) for _ in range(req.n)]
    with live_requests(request).track(rid, request.get("client_request_id"),
                                      lambda: any(s.thinking for s in splitters)):
        async with contextlib.aclosing(generate(port, rid, prompt.ids, params, req, request=request,
                                                keepalive=req.stream)) as deltas:
            if not req.stream:
                return await _complete(request, ctx, deltas, splitters)
            return await _stream(request, ctx, deltas, splitters)


class _Ctx:
    def __init__(self, port, tm, req: GenerateRequest, rid: str, prompt_len: int):
        self.tok, self.req, self.rid, self.prompt_len = tm.tokenizer, req, rid, prompt_len
        self.created = int(time.time())
        self.model = port.card.name
        self.fp = fingerprint(port.card)
        plan = req.tool_plan
        self.tools = plan if plan is not None and plan.active else None  # calls are parsed back


def _tool_calls_json(calls) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _finish(label: str, has_calls: bool) -> str:
    # a reply cut by max_tokens stays "length" even when it began a call
    return "tool_calls" if has_calls and label != "length" else label


async def _complete(request, ctx: _Ctx, deltas, splitters) -> web.Response:
    tok, gen, prompt_len = ctx.tok, ctx.req, ctx.prompt_len
    texts = [""] * gen.n
    thoughts = [""] * gen.n
    lps: list[list] = [[] for _ in range(gen.n)]
    finish = ["stop"] * gen.n
    completion = [0] * gen.n
    cached = 0
    try:
        async for d in deltas:
            r, c = split_delta(splitters[d.index], d)
            thoughts[d.index] += r
            texts[d.index] += c
            lps[d.index].extend(d.logprobs)
            if d.finish != FinishReason.NONE:
                finish[d.index] = finish_label(d.finish)
            prompt_len, cached = d.prompt_tokens or prompt_len, d.cached_tokens
            completion[d.index] = d.completion_tokens
    except StreamFault as exc:  # nothing was sent yet: a plain 500
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    choices = []
    for i in range(gen.n):
        msg = {"role": "assistant", "content": texts[i]}
        fin = finish[i]
        if ctx.tools is not None:
            parsed = ctx.tools.parse(texts[i], cut=fin == "length")
            msg["content"] = parsed.content or None if parsed.calls else parsed.content
            if parsed.calls:
                msg["tool_calls"] = _tool_calls_json(parsed.calls)
            fin = _finish(fin, bool(parsed.calls))
        if splitters[i].saw_think:
            msg["reasoning_content"] = msg["reasoning"] = thoughts[i]
        choices.append({
            "index": i,
            "message": msg,
            "logprobs": {"content": chat_content(tok, lps[i], gen.top_logprobs)} if gen.logprobs else None,
            "finish_reason": fin,
        })
    return web.json_response(
        {
            "id": ctx.rid,
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "system_fingerprint": ctx.fp,
            "choices": choices,
            "usage": usage_json(prompt_len, sum(completion), cached),
        },
        headers={"X-Request-Id": request["response_id"]},
    )


async def _stream(request, ctx: _Ctx, deltas, splitters) -> web.StreamResponse:
    """Per-token SSE; the first chunk of each choice carries the role. With tools, text that
    may start a call is held back (never leaks into content) and a call streams as OpenAI's
    clients expect: its first delta carries index, id, type, name and arguments "", later
    ones argument fragments; the choice finishes with "tool_calls"."""
    tok, gen, prompt_len = ctx.tok, ctx.req, ctx.prompt_len
    resp = None
    base = {"id": ctx.rid, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.fp}

    def chunk(choices, usage=None) -> bytes:
        c = dict(base, choices=choices)
        if gen.include_usage:
            c["usage"] = usage
        return sse_data(c)

    def delta_chunk(i: int, delta: dict, lp=None) -> bytes:
        return chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}])

    parsers = [ctx.tools.stream_parser() for _ in range(gen.n)] if ctx.tools is not None else None
    called = [False] * gen.n

    def tool_chunks(i: int, events) -> list[bytes]:
        out = []
        for ev in events:
            if isinstance(ev, Text):
                if ev.text:
                    out.append(delta_chunk(i, {"content": ev.text}))
            elif isinstance(ev, CallStart):
                called[i] = True
                out.append(delta_chunk(i, {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                           "function": {"name": ev.name, "arguments": ""}}]}))
            elif isinstance(ev, ArgsDelta):
                out.append(delta_chunk(i, {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}))
        return out

    completion = [0] * gen.n
    prompt_tokens, cached = prompt_len, 0
    try:
        async for d in deltas:
            if resp is None:
                resp = await sse_start(request, request["response_id"])
                await resp.write(b"".join(
                    chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                    for i in range(gen.n)
                ))
            if d is None:  # queued or prefilling: the role chunk above, then an SSE comment now and then
                await resp.write(KEEPALIVE_COMMENT)
                continue
            i = d.index
            completion[i] = d.completion_tokens
            prompt_tokens, cached = d.prompt_tokens or prompt_tokens, d.cached_tokens
            done = d.finish != FinishReason.NONE
            r, c = split_delta(splitters[i], d)
            lp = {"content": chat_content(tok, d.logprobs, gen.top_logprobs)} if gen.logprobs else None
            out: list[bytes] = []
            if r:
                out.append(delta_chunk(i, {"reasoning_content": r, "reasoning": r}, lp if not c else None))
            if parsers is not None:
                cut = d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)
                out += tool_chunks(i, parsers[i].push(c) + (ctx.tools.finish(parsers[i], cut) if done else []))
                if lp is not None and not r and d.logprobs:  # logprobs of held-back text still go out
                    out.append(delta_chunk(i, {}, lp))
            elif c or (not r and d.logprobs):
                out.append(delta_chunk(i, {"content": c}, lp))
            if done:
                out.append(chunk([{"index": i, "delta": {}, "logprobs": None,
                                   "finish_reason": _finish(finish_label(d.finish), called[i])}]))
            if out:
                await resp.write(b"".join(out))
        usage = chunk([], usage_json(prompt_tokens, sum(completion), cached)) if gen.include_usage else None
        resp = await sse_end(request, resp, usage)
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, error_event, f"chat stream {ctx.rid}")
    return resp
