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

import contextlib
import functools
import json
import logging
import uuid

from aiohttp import web

from imp.http.app import ENGINE
from imp.http.control import live_requests
from imp.http.driver import StreamFault, generate, stream_failed
from imp.http.errors import ApiError, bad, error_body, error_response
from imp.http.openai_chat import prepare_prompt, read_json
from imp.http.params import boolean, num, sampling
from imp.http.reasoning import ThinkSplitter, split_delta
from imp.messages import FinishReason

log = logging.getLogger("imp.http")

_MEDIA = {"image", "document"}
_TOOL_CHOICES = {"auto", "any", "tool", "none"}
_THINKING = {"enabled", "disabled", "adaptive"}
# imp's own fields, accepted here as on the other dialects
_IMP_FIELDS = ("seed", "priority", "cache_prompt", "session_id", "min_p", "repetition_penalty", "ignore_eos")
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
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


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
    """One Anthropic message -> template messages (a user turn may carry tool results)."""
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad(f"'{where}.role' must be 'user' or 'assistant'", f"{where}.role")
    content = m.get("content")
    if content is None:
        raise bad(f"'{where}.content' is required", f"{where}.content")
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


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be an array", "tools")
    out = []
    for i, t in enumerate(tools or []):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"'{w}' must be an object with a non-empty string 'name'", w)
        schema = t.get("input_schema")
        if schema is None:
            if t.get("type") in (None, "custom"):
                raise bad(f"'{w}.input_schema' is required", f"{w}.input_schema")
            continue  # a server tool (web_search, bash_...): nothing for the template to show
        if not isinstance(schema, dict):
            raise bad(f"'{w}.input_schema' must be an object", f"{w}.input_schema")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"'{w}.description' must be a string", f"{w}.description")
        out.append({"type": "function", "function": {"name": t["name"], "description": desc or "", "parameters": schema}})
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
            raise bad(f"'tool_choice' must be an object with 'type' one of {sorted(_TOOL_CHOICES)}", "tool_choice")
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise bad("'tool_choice.name' must be a string when 'type' is 'tool'", "tool_choice.name")
        if choice["type"] == "none":
            return None  # accepted, not enforced; "none" keeps the tools out of the prompt
    return out or None


def _template_kwargs(body: dict) -> dict:
    th = body.get("thinking")
    if th is None:
        return {}
    if not isinstance(th, dict) or th.get("type") not in _THINKING:
        raise bad(f"'thinking' must be an object with 'type' one of {sorted(_THINKING)}", "thinking")
    if th.get("budget_tokens") is not None:
        num(th, "budget_tokens", 1, integer=True)
    # accepted; templates that know enable_thinking (Qwen3 ...) follow it
    return {"enable_thinking": th["type"] != "disabled"}


def _prompt(engine, body: dict) -> tuple[list[int], bool]:
    """Validate the prompt fields, render, tokenize; also say whether a think block is open."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
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
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad("'metadata' must be an object", "metadata")
        if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            raise bad("'metadata.user_id' must be a string", "metadata.user_id")
    last = msgs[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"].strip())
    opts = {"tools": _tools(body), "continue_final_message": prefill, "chat_template_kwargs": _template_kwargs(body)}
    if "tool_calls" not in engine.template.source:
        msgs = [_calls_as_text(m) for m in msgs]  # the template would drop them silently
    try:
        return prepare_prompt(engine, msgs, opts)
    except ApiError as err:
        if err.code != "template_error" or not any(m["role"] == "tool" or m.get("tool_calls") for m in msgs):
            raise
    # best effort: a template that refuses tool turns gets them as plain text
    return prepare_prompt(engine, _tools_as_text(msgs), opts)


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


def _gen(engine, body: dict, prompt_len: int):
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required", "max_tokens")
    num(body, "max_tokens", 1, integer=True)
    num(body, "temperature", 0, 1)
    num(body, "top_k", 0, integer=True)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("'stop_sequences' must be an array of strings", "stop_sequences")
        if len(stops) > 16:
            raise bad("'stop_sequences' takes at most 16 strings", "stop_sequences")
    boolean(body, "stream")
    sub = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stream", *_IMP_FIELDS) if k in body}
    sub["stop"] = stops or None
    return sampling(
        sub,
        defaults=engine.defaults,
        vocab_size=engine.tokenizer.vocab_size,
        prompt_len=prompt_len,
        max_context=engine.max_context,
        fixed_max_tokens=engine.cfg.max_tokens,
        eos_ids=tuple(sorted(engine.tokenizer.eos_ids)),
    )


# --------------------------------------------------------------------------- handlers


async def _read(request: web.Request) -> dict:
    return await read_json(request)  # surrogates and deep nesting are 400s there


@_route
async def count_tokens(request: web.Request, echo: dict) -> web.Response:
    engine = request.app[ENGINE]
    body = await _read(request)
    prompt, _ = _prompt(engine, body)
    return web.json_response({"input_tokens": len(prompt)})


@_route
async def messages(request: web.Request, echo: dict) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _read(request)
    prompt, thinking = _prompt(engine, body)
    gen = _gen(engine, body, len(prompt))
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or mid
    splitter = ThinkSplitter(thinking)
    with live_requests(request).track(mid, request.get("client_request_id"), lambda: splitter.thinking):
        async with contextlib.aclosing(generate(engine, mid, prompt, gen, endpoint="messages")) as deltas:
            if gen.stream:
                return await _stream(request, engine, deltas, mid, len(prompt), splitter, echo)
            return await _complete(request, engine, deltas, mid, len(prompt), splitter)


def _stop(d) -> tuple[str, str | None]:
    if d.finish == FinishReason.STOP and d.stop_str:
        return "stop_sequence", d.stop_str
    if d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return "max_tokens", None
    return "end_turn", None


def _usage(prompt: int, completion: int, cached: int) -> dict:
    # Anthropic counts input_tokens after the cache: input + cache_read = the whole prompt
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message(engine, mid: str, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": engine.model_name, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


async def _complete(request, engine, deltas, mid, prompt_len, splitter) -> web.Response:
    text = thought = ""
    stop: tuple[str | None, str | None] = ("end_turn", None)
    completion = cached = 0
    try:
        async for d in deltas:
            r, c = split_delta(splitter, d)
            thought, text = thought + r, text + c
            prompt_len, cached, completion = d.prompt_tokens or prompt_len, d.cached_tokens, d.completion_tokens
            if d.finish != FinishReason.NONE:
                stop = _stop(d)
    except StreamFault as exc:  # nothing was sent yet: a plain 500
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    content = []
    if splitter.saw_think:
        content.append({"type": "thinking", "thinking": thought, "signature": ""})
    if text or not content:
        content.append({"type": "text", "text": text})
    return web.json_response(
        _message(engine, mid, content, stop, _usage(prompt_len, completion, cached)),
        headers={"X-Request-Id": request["response_id"]},
    )


async def _stream(request, engine, deltas, mid, prompt_len, splitter, echo) -> web.StreamResponse:
    """Anthropic's named events; blocks open as their first text arrives."""
    resp = None
    index, open_kind = -1, None
    stop: tuple[str | None, str | None] = ("end_turn", None)
    completion = cached = 0

    async def block(kind: str) -> None:
        nonlocal index, open_kind
        if open_kind == kind:
            return
        if open_kind is not None:
            await resp.write(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        index, open_kind = index + 1, kind
        start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
        await resp.write(_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))

    try:
        async for d in deltas:
            prompt_len, cached, completion = d.prompt_tokens or prompt_len, d.cached_tokens, d.completion_tokens
            if resp is None:
                resp = await _sse_start(request, echo)
                msg = _message(engine, mid, [], (None, None), _usage(prompt_len, completion, cached))
                await resp.write(_event("message_start", {"type": "message_start", "message": msg})
                                 + _event("ping", {"type": "ping"}))
            r, c = split_delta(splitter, d)
            if r or (splitter.saw_think and open_kind is None and index < 0):
                await block("thinking")
                if r:
                    await resp.write(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                                    "delta": {"type": "thinking_delta", "thinking": r}}))
            if c:
                await block("text")
                await resp.write(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                                "delta": {"type": "text_delta", "text": c}}))
            if d.finish != FinishReason.NONE:
                stop = _stop(d)
        if resp is None:  # nothing at all came back (cannot normally happen)
            resp = await _sse_start(request, echo)
            await resp.write(_event("message_start", {"type": "message_start", "message": _message(
                engine, mid, [], (None, None), _usage(prompt_len, 0, 0))}))
        if open_kind is None:
            await block("text")  # an empty reply is still one (empty) text block, as non-stream
        await resp.write(
            _event("content_block_stop", {"type": "content_block_stop", "index": index})
            + _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                       "usage": _usage(prompt_len, completion, cached)})
            + _event("message_stop", {"type": "message_stop"})
        )
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, lambda message, _code: _error_event(request, 500, message),
                            f"messages stream {mid}")
    return resp


def _error_event(request, status: int, message: str) -> bytes:
    return _event("error", error_body(request.path, ApiError(status, message), request["request_id"]))


async def _sse_start(request: web.Request, echo: dict) -> web.StreamResponse:
    # the middleware cannot add headers to a prepared response: set them all here
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": request["response_id"],
            "request-id": request["request_id"],
            "X-Accel-Buffering": "no",
            **echo,
        }
    )
    await resp.prepare(request)
    return resp
