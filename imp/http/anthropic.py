"""POST /v1/messages and /v1/messages/count_tokens — the Anthropic Messages dialect.

Native to Anthropic's wire format: the request's blocks become template
messages (tool_use -> the assistant's tool_calls, tool_result -> a tool
message), the reply comes back as content blocks, a stream as Anthropic's
named SSE events. Generation goes through the shared driver like every other
dialect. A trailing assistant turn with text is a prefill: the reply continues
it. Errors take Anthropic's shape (the middleware picks it by path); every
response carries `request-id` and echoes `anthropic-version` / `anthropic-beta`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid

from aiohttp import web

import msgspec

from imp.http import body as B
from imp.http import keys, resolve, structured, tool_use
from imp.http.control import live_requests
from imp.http.driver import StreamFault, generate, sse_start, stream_failed
from imp.http.errors import ApiError, bad, error_body, error_response
from imp.http.reasoning import ThinkSplitter, split_delta
from imp.http.request import GenerateRequest, Message, Sampling
from imp.messages import FinishReason
from imp.tools import ArgsDelta, CallStart, Text, ToolSpecError, from_anthropic, reprefix

log = logging.getLogger("imp.http")

_MEDIA = {"image", "document"}
_THINKING = {"enabled", "disabled", "adaptive"}
_betas_seen: set[str] = set()


# --------------------------------------------------------------------------- headers, errors


def _echo(request: web.Request) -> dict[str, str]:
    """anthropic-version / anthropic-beta are read and echoed, never enforced."""
    out = {}
    for h in ("anthropic-version", "anthropic-beta"):
        v = request.headers.get(h)
        if v:
            out[h] = v[:256]
    for beta in (b.strip() for b in out.get("anthropic-beta", "").split(",")):
        if beta and beta not in _betas_seen and len(_betas_seen) < 256:
            _betas_seen.add(beta)
            log.info("anthropic-beta %r is not implemented; ignored", beta)
    return out


def _route(fn):
    """Render ApiError here (not in the middleware) so the error echoes the headers too."""

    @functools.wraps(fn)
    async def handler(request: web.Request) -> web.StreamResponse:
        echo = _echo(request)
        try:
            resp = await fn(request, echo)
        except ApiError as err:
            resp = error_response(request, err, request["request_id"])
        if not resp.prepared:
            resp.headers.update(echo)
        return resp

    return handler


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + msgspec.json.encode(data) + b"\n\n"


# --------------------------------------------------------------------------- request -> template


def _text(v, where: str) -> str:
    """A string, or an array of text blocks (system, tool_result content)."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(f"'{where}' must be a string or an array of text blocks", where)
    parts = []
    for j, b in enumerate(v):
        bw = f"{where}[{j}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"'{bw}' must be an object with a 'type'", bw)
        if b["type"] in _MEDIA:
            raise bad(f"'{bw}': this model is text-only and cannot take '{b['type']}' content", bw)
        if b["type"] != "text":
            raise bad(f"'{bw}': expected a 'text' block, got '{b['type']}'", bw)
        if not isinstance(b.get("text"), str):
            raise bad(f"'{bw}.text' must be a string", bw)
        parts.append(b["text"])
    return "\n\n".join(parts)


def _blocks(m: dict, where: str, names: dict[str, str]) -> list[dict]:
    """One Anthropic message -> template messages (a user turn may carry tool results).
    A `system` message inside `messages` (Claude Code's mid-conversation system beta) is a
    system turn at that point of the conversation."""
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise bad(f"'{where}.role' must be 'user', 'assistant' or 'system'", f"{where}.role")
    content = m.get("content")
    if content is None:
        raise bad(f"'{where}.content' is required", f"{where}.content")
    if role == "system":
        return [{"role": "system", "content": _text(content, f"{where}.content")}]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"'{where}.content' must be a string or an array of content blocks", f"{where}.content")
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, b in enumerate(content):
        bw = f"{where}.content[{j}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"'{bw}' must be an object with a 'type'", bw)
        t = b["type"]
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise bad(f"'{bw}.text' must be a string", bw)
            texts.append(b["text"])
        elif t in _MEDIA:
            raise bad(f"'{bw}': this model is text-only and cannot take '{t}' content", bw)
        elif t == "tool_use":
            if role != "assistant":
                raise bad(f"'{bw}': tool_use blocks belong in assistant turns", bw)
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad(f"'{bw}' needs a string 'id' and 'name'", bw)
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise bad(f"'{bw}.input' must be an object", bw)
            names[b["id"]] = b["name"]
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        elif t == "tool_result":
            if role != "user":
                raise bad(f"'{bw}': tool_result blocks belong in user turns", bw)
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                raise bad(f"'{bw}.tool_use_id' must be a string", bw)
            err = b.get("is_error")
            if err is not None and not isinstance(err, bool):
                raise bad(f"'{bw}.is_error' must be a boolean", bw)
            out = "" if b.get("content") is None else _text(b["content"], f"{bw}.content")
            msg = {"role": "tool", "tool_call_id": tid, "content": f"Error: {out}" if err else out}
            if tid in names:
                msg["name"] = names[tid]
            results.append(msg)
        elif t in ("thinking", "redacted_thinking"):
            if role != "assistant":
                raise bad(f"'{bw}': {t} blocks belong in assistant turns", bw)
            # earlier turns' thinking is not shown to the model again (Anthropic does the same)
        else:
            raise bad(f"'{bw}': unknown content block type '{t}'", bw)
    out = results
    if role == "assistant":
        msg = {"role": "assistant", "content": "\n\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool_plan(body: dict, template_source: str, messages=()):
    """tools / tool_choice -> the request's ToolPlan (None without tools). Server tools
    (web_search, bash, ...: a `type` other than custom) run on Anthropic's side and are left
    out; cache_control on a tool is accepted (prefix caching is automatic here)."""
    try:
        specs, choice = from_anthropic(body.get("tools"), body.get("tool_choice"))
    except ToolSpecError as exc:
        raise bad(exc.message, exc.param) from None
    return tool_use.plan(specs, choice, template_source, messages)


_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # Claude Code's --effort offers all five


def _template_kwargs(body: dict) -> dict:
    """thinking (enabled / adaptive / disabled, budget_tokens) and output_config.effort:
    templates that think (Qwen3 ...) follow enable_thinking; a model that does not think
    simply does not open a think block."""
    kw = {}
    th = body.get("thinking")
    if th is not None:
        if not isinstance(th, dict) or th.get("type") not in _THINKING:
            raise bad(f"'thinking' must be an object with 'type' one of {sorted(_THINKING)}", "thinking")
        if th.get("budget_tokens") is not None:
            B.num(th, "budget_tokens", 1, integer=True, where="thinking.budget_tokens")
        kw["enable_thinking"] = th["type"] != "disabled"
    oc = body.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise bad("'output_config' must be an object", "output_config")
        effort = oc.get("effort")
        if effort is not None and effort not in _EFFORTS:
            raise bad(f"'output_config.effort' must be one of {', '.join(_EFFORTS)}", "output_config.effort")
        if effort is not None:  # to the template as the Responses dialect passes reasoning.effort
            kw["reasoning_effort"] = effort
    cm = body.get("context_management")
    if cm is not None and not isinstance(cm, dict):
        raise bad("'context_management' must be an object", "context_management")
    # context_management edits (clear_thinking, clear_tool_uses) shrink a long conversation on
    # Anthropic's side; here earlier thinking is never shown again anyway and the prompt is
    # the client's to size: accepted, with no edit applied (documented in FEATURES.md)
    return kw


def _messages(body: dict) -> list[dict]:
    """system + messages -> template message dicts (consecutive same-role turns joined)."""
    msgs: list[dict] = []
    if body.get("system") is not None:
        system = _text(body["system"], "system")
        if system:
            msgs.append({"role": "system", "content": system})
    raw = body.get("messages")
    if raw is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object", f"messages[{i}]")
        for msg in _blocks(m, f"messages[{i}]", names):
            prev = msgs[-1] if msgs else None
            # consecutive turns of one role join, as Anthropic does
            if prev and prev["role"] == msg["role"] == "user":
                prev["content"] = "\n\n".join(c for c in (prev["content"], msg["content"]) if c)
            elif prev and prev["role"] == msg["role"] == "assistant":
                prev["content"] = "\n\n".join(c for c in (prev["content"], msg["content"]) if c)
                if msg.get("tool_calls"):
                    prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
            else:
                msgs.append(msg)
    return msgs


def _sampling(body: dict) -> Sampling:
    """Anthropic's ranges (temperature 0..1, top_k >= 0) and imp's own fields."""
    return Sampling(
        temperature=B.num(body, "temperature", 0, 1),
        top_p=B.num(body, "top_p", 0, 1, lo_open=True),
        top_k=B.num(body, "top_k", 0, integer=True),
        min_p=B.num(body, "min_p", 0, 1),
        repetition_penalty=B.num(body, "repetition_penalty", 0, lo_open=True),
        seed=B.num(body, "seed", integer=True),
        ignore_eos=B.boolean(body, "ignore_eos"),
    )


def parse(body: dict, template_source: str = "", *, count_only: bool = False) -> GenerateRequest:
    """A Messages body -> the typed request. A trailing assistant turn with text is a prefill.
    count_only: /v1/messages/count_tokens, whose body has no max_tokens."""
    model = B.model_name(body)
    B.refuse_request_template(body)
    msgs = _messages(body)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad("'metadata' must be an object", "metadata")
        if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            raise bad("'metadata.user_id' must be a string", "metadata.user_id")
    last = msgs[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"].strip())
    plan = _tool_plan(body, template_source, [_msg(m) for m in msgs])
    kw = _template_kwargs(body)
    constraint, field = structured.parse(body, dialect="anthropic")
    tool_use.check_compatible(plan, constraint, field)
    if plan is None and "tool_calls" not in template_source:
        msgs = [_calls_as_text(m) for m in msgs]  # the template would drop them silently
    if body.get("max_tokens") is None and not count_only:
        raise bad("'max_tokens' is required", "max_tokens")
    max_tokens = B.num(body, "max_tokens", 1, integer=True)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("'stop_sequences' must be an array of strings", "stop_sequences")
        if len(stops) > 16:
            raise bad("'stop_sequences' takes at most 16 strings", "stop_sequences")
    messages = tuple(_msg(m) for m in msgs)
    if plan is not None:
        messages = tool_use.apply_to_messages(plan, messages)
    return GenerateRequest(
        endpoint="messages", model=model, messages=messages, tools=plan.template_tools() if plan else (),
        continue_final_message=prefill, add_generation_prompt=not prefill, template_kwargs=kw,
        constraint=constraint, constraint_field=field, tool_plan=plan,
        sampling=_sampling(body), max_tokens=max_tokens, stop=tuple(s for s in stops or () if s),
        stream=B.boolean(body, "stream"),
        priority=B.num(body, "priority", -(2**31), 2**31 - 1, integer=True, default=0),
        cache_prompt=B.boolean(body, "cache_prompt"), session_id=B.session_id(body), lora=B.lora_name(body),
    )


def _msg(m: dict) -> Message:
    return Message(role=m["role"], content=m["content"], name=m.get("name"),
                   tool_calls=tuple(m["tool_calls"]) if m.get("tool_calls") else None,
                   tool_call_id=m.get("tool_call_id"))


async def _render_off_loop(req: GenerateRequest, tm, card) -> resolve.Prompt:
    resolve.check_size(req, tm, card)
    return await asyncio.to_thread(_render, req, tm)


def _render(req: GenerateRequest, tm) -> resolve.Prompt:
    try:
        return resolve.render(req, tm)
    except ApiError as err:
        if err.code != "template_error" or not any(m.role == "tool" or m.tool_calls for m in req.messages):
            raise
    # best effort: a template that refuses tool turns gets them as plain text
    text_msgs = _tools_as_text([m.template_dict() for m in req.messages])
    return resolve.render(msgspec.structs.replace(req, messages=tuple(_msg(m) for m in text_msgs)), tm)


def _calls_as_text(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = "\n".join(
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                     ensure_ascii=False) + "\n</tool_call>"
        for c in m["tool_calls"]
    )
    return {"role": m["role"], "content": "\n\n".join(t for t in (m["content"], calls) if t)}


def _tools_as_text(msgs: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in msgs:
        m = _calls_as_text(m)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        if out and out[-1]["role"] == m["role"] and m["role"] != "system":
            out[-1] = dict(out[-1], content=out[-1]["content"] + "\n\n" + m["content"])
        else:
            out.append(m)
    return out


# --------------------------------------------------------------------------- handlers


@_route
async def count_tokens(request: web.Request, echo: dict) -> web.Response:
    tm = request.app[keys.TEXT]
    req = parse(await B.read_json(request), tm.template.source, count_only=True)
    prompt = await _render_off_loop(req, tm, request.app[keys.PORT].card)
    return web.json_response({"input_tokens": len(prompt.ids)})


@_route
async def messages(request: web.Request, echo: dict) -> web.StreamResponse:
    port, tm, cfg = request.app[keys.PORT], request.app[keys.TEXT], request.app[keys.CONFIG]
    req = parse(await B.read_json(request), tm.template.source)
    await resolve.compile_constraint(req, request.app[keys.GRAMMARS])
    prompt = await _render_off_loop(req, tm, port.card)
    params = resolve.sampling_params(req, len(prompt.ids), port.card, tm, cfg.max_tokens, cfg.max_output_tokens)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or mid
    splitter = ThinkSplitter(prompt.opens_think)
    plan = req.tool_plan if req.tool_plan is not None and req.tool_plan.active else None
    ctx = _Ctx(port.card.name, mid, len(prompt.ids), splitter, plan)
    with live_requests(request).track(mid, request.get("client_request_id"), lambda: splitter.thinking):
        async with contextlib.aclosing(generate(port, mid, prompt.ids, params, req, request=request,
                                                keepalive=req.stream)) as deltas:
            if req.stream:
                return await _stream(request, ctx, deltas, echo)
            return await _complete(request, ctx, deltas)


class _Ctx:
    def __init__(self, model: str, mid: str, prompt_len: int, splitter: ThinkSplitter, plan):
        self.model, self.mid, self.prompt_len, self.splitter, self.plan = model, mid, prompt_len, splitter, plan


def _stop(d, called: bool = False) -> tuple[str, str | None]:
    if d.finish == FinishReason.STOP and d.stop_str:
        return "stop_sequence", d.stop_str
    if d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return "max_tokens", None
    return ("tool_use" if called else "end_turn"), None


def _usage(prompt: int, completion: int, cached: int) -> dict:
    # Anthropic counts input_tokens after the cache: input + cache_read = the whole prompt
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message(model: str, mid: str, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _tool_use_block(call) -> dict:
    return {"type": "tool_use", "id": reprefix(call.id, "toolu_"), "name": call.name,
            "input": json.loads(call.arguments or "{}")}


async def _complete(request, ctx: _Ctx, deltas) -> web.Response:
    text = thought = ""
    last = None
    completion = cached = 0
    prompt_len, splitter = ctx.prompt_len, ctx.splitter
    try:
        async for d in deltas:
            r, c = split_delta(splitter, d)
            thought, text = thought + r, text + c
            prompt_len, cached, completion = d.prompt_tokens or prompt_len, d.cached_tokens, d.completion_tokens
            if d.finish != FinishReason.NONE:
                last = d
    except StreamFault as exc:  # nothing was sent yet: a plain 500
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    content = []
    if splitter.saw_think:
        content.append({"type": "thinking", "thinking": thought, "signature": ""})
    calls = ()
    if ctx.plan is not None:
        parsed = ctx.plan.parse(text, cut=last is not None and last.finish in (FinishReason.LENGTH,
                                                                               FinishReason.TIMEOUT))
        text, calls = parsed.content, parsed.calls
    if text or not (content or calls):
        content.append({"type": "text", "text": text})
    content += [_tool_use_block(c) for c in calls]
    stop = _stop(last, bool(calls)) if last is not None else ("end_turn", None)
    return web.json_response(
        _message(ctx.model, ctx.mid, content, stop, _usage(prompt_len, completion, cached)),
        headers={"X-Request-Id": request["response_id"]},
    )


async def _stream(request, ctx: _Ctx, deltas, echo) -> web.StreamResponse:
    """Anthropic's named events; blocks open as their first text arrives, one start per
    block, deltas of the block's own type: thinking_delta, text_delta, and for a tool call
    content_block_start {tool_use, id, name, input: {}} then input_json_delta.partial_json."""
    resp = None
    index, open_kind = -1, None
    last = None
    called = False
    completion = cached = 0
    prompt_len, splitter = ctx.prompt_len, ctx.splitter
    parser = ctx.plan.stream_parser() if ctx.plan is not None else None
    out: list[bytes] = []

    def block(kind: str, start: dict | None = None) -> None:
        nonlocal index, open_kind
        if open_kind == kind and start is None:
            return
        if open_kind is not None:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        index, open_kind = index + 1, kind
        if start is None:
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
        out.append(_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))

    def delta(d: dict) -> None:
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}))

    def text_out(c: str) -> None:
        if c:
            block("text")
            delta({"type": "text_delta", "text": c})

    def tool_events(events) -> None:
        nonlocal called
        for ev in events:
            if isinstance(ev, Text):
                text_out(ev.text)
            elif isinstance(ev, CallStart):
                called = True
                block("tool_use", {"type": "tool_use", "id": reprefix(ev.id, "toolu_"), "name": ev.name, "input": {}})
            elif isinstance(ev, ArgsDelta):
                delta({"type": "input_json_delta", "partial_json": ev.text})

    async def start(cached: int) -> web.StreamResponse:
        r = await _sse_start(request, echo)
        msg = _message(ctx.model, ctx.mid, [], (None, None), _usage(prompt_len, 0, cached))
        out.append(_event("message_start", {"type": "message_start", "message": msg}) + _PING)
        return r

    try:
        async for d in deltas:
            if d is None:  # queued or prefilling: message_start now, then a ping every few seconds
                if resp is None:
                    resp = await start(0)
                else:
                    out.append(_PING)
                await resp.write(b"".join(out))
                out.clear()
                continue
            prompt_len, cached, completion = d.prompt_tokens or prompt_len, d.cached_tokens, d.completion_tokens
            if resp is None:
                resp = await start(cached)
            r, c = split_delta(splitter, d)
            done = d.finish != FinishReason.NONE
            if r or (splitter.saw_think and open_kind is None and index < 0):
                block("thinking")
                if r:
                    delta({"type": "thinking_delta", "thinking": r})
            if parser is not None:
                cut = d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)
                tool_events(parser.push(c) + (ctx.plan.finish(parser, cut) if done else []))
            else:
                text_out(c)
            if done:
                last = d
            if out:
                await resp.write(b"".join(out))
                out.clear()
        if resp is None:  # nothing at all came back (cannot normally happen)
            resp = await _sse_start(request, echo)
            out.append(_event("message_start", {"type": "message_start", "message": _message(
                ctx.model, ctx.mid, [], (None, None), _usage(prompt_len, 0, 0))}))
        if open_kind is None:
            block("text")  # an empty reply is still one (empty) text block, as non-stream
        stop = _stop(last, called) if last is not None else ("end_turn", None)
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index})
                   + _event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                              "usage": _usage(prompt_len, completion, cached)})
                   + _event("message_stop", {"type": "message_stop"}))
        await resp.write(b"".join(out))
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, lambda message, _code: _error_event(request, 500, message),
                            f"messages stream {ctx.mid}")
    return resp


_PING = _event("ping", {"type": "ping"})


def _error_event(request, status: int, message: str) -> bytes:
    return _event("error", error_body(request.path, ApiError(status, message), request["request_id"]))


async def _sse_start(request: web.Request, echo: dict) -> web.StreamResponse:
    return await sse_start(request, request["response_id"], **{"request-id": request["request_id"]}, **echo)
