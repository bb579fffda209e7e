"""POST /v1/chat/completions — the OpenAI chat dialect."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

from aiohttp import web

from imp.http.app import ENGINE
from imp.http.control import live_requests
from imp.http.driver import StreamFault, generate, sse_end, sse_start, stream_failed
from imp.http.errors import ApiError, bad
from imp.http.logprobs import chat_content
from imp.http.params import boolean, sampling
from imp.http.reasoning import ThinkSplitter, prompt_opens_think, split_delta
from imp.messages import FinishReason

log = logging.getLogger("imp.http")

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_MEDIA = {"image_url", "input_image", "image", "input_audio", "audio", "video", "video_url", "file"}


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object; every way it can be malformed is a 400 (all dialects use this)."""
    try:
        body = await request.json(loads=json.loads)
        # a lone UTF-16 surrogate ("\ud800") parses but cannot be encoded: find it now,
        # not as a 500 deep in the tokenizer
        json.dumps(body, ensure_ascii=False).encode()
    except RecursionError:
        raise bad("request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise bad("request body holds an unpaired UTF-16 surrogate (\\ud800-\\udfff) in a string") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    return body


def normalize_messages(raw) -> list[dict]:
    """Validate OpenAI messages; return template-ready dicts (content as text)."""
    if raw is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
        content = m.get("content")
        if content is None:
            if role not in ("assistant",) or not m.get("tool_calls"):
                if role != "assistant":
                    raise bad(f"{where}.content is required", f"{where}.content")
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                    raise bad(f"{pw} must be an object with a 'type'", pw)
                if p["type"] in ("text", "input_text"):
                    if not isinstance(p.get("text"), str):
                        raise bad(f"{pw}.text must be a string", pw)
                    parts.append(p["text"])
                elif p["type"] in _MEDIA:
                    raise bad(f"{pw}: this model is text-only and cannot take '{p['type']}' content", pw,
                              "unsupported_content_type")
                else:
                    raise bad(f"{pw}: unknown content part type '{p['type']}'", pw)
            text = "".join(parts)
        else:
            raise bad(f"{where}.content must be a string or an array of content parts", f"{where}.content")
        msg = {"role": "system" if role == "developer" else role, "content": text}
        for k in ("name", "tool_calls", "tool_call_id"):
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)
    return out


_RESERVED_KW = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}


def prepare_prompt(engine, messages: list[dict], body: dict) -> tuple[list[int], bool]:
    """Render and tokenize; also say whether the prompt leaves a think block open.

    continue_final_message (vLLM): the reply continues the last message, an
    assistant turn with text; the prompt is the render without a generation
    prompt, cut right after that text (the HF rule, trailing whitespace
    dropped).
    """
    from imp.text.chat_template import TemplateError

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be an array", "tools")
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kw = {k: v for k, v in (kw or {}).items() if isinstance(k, str) and k not in _RESERVED_KW}
    cont = boolean(body, "continue_final_message")
    add_gen = body.get("add_generation_prompt")
    if add_gen is not None and not isinstance(add_gen, bool):
        raise bad("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    if cont:
        if add_gen:
            raise bad("'continue_final_message' and 'add_generation_prompt': true cannot be combined",
                      "add_generation_prompt")
        last = messages[-1]
        if last["role"] != "assistant" or last.get("tool_calls") or not last["content"].strip():
            raise bad("'continue_final_message' needs the last message to be an assistant turn with text "
                      "and no tool_calls", "messages")
        add_gen = False
    elif add_gen is None:
        add_gen = True
    try:
        parts = engine.template.render_parts(messages, add_generation_prompt=add_gen, tools=tools or None, **kw)
    except TemplateError as exc:
        raise bad(f"chat template error: {exc}", "messages", "template_error") from None
    if cont:
        final = messages[-1]["content"]
        k = max((i for i, (_, trusted) in enumerate(parts) if not trusted), default=-1)
        if k < 0 or parts[k][0].strip() != final.strip():
            raise bad("the chat template does not render the final message's text; cannot continue it",
                      "messages", "template_error")
        parts = parts[:k] + [(parts[k][0].rstrip(), False)]
    prompt = engine.tokenizer.encode_chat(parts, add_special=True)
    # add_special above: BOS when the model wants one and the template did not write it.
    # A think block is open when the reply's own start opens one: the assistant
    # prefix being continued, or the template's text after the last message.
    k = max((i for i, (_, trusted) in enumerate(parts) if not trusted), default=-1)
    tail = parts[-1][0] if cont else "".join(t for t, _ in parts[k + 1:])
    return prompt, prompt_opens_think(tail)


def usage_json(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def error_event(message: str, code: str = "engine_faulted") -> bytes:
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json(request)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if boolean(body, "dry_run"):  # POST /v1/estimate's answer; nothing runs
        from imp.http.capacity import estimate_for  # capacity imports this module

        return web.json_response(estimate_for(engine, body))
    messages = normalize_messages(body.get("messages"))
    prompt, thinking = prepare_prompt(engine, messages, body)
    gen = sampling(
        body,
        defaults=engine.defaults,
        vocab_size=engine.tokenizer.vocab_size,
        prompt_len=len(prompt),
        max_context=engine.max_context,
        fixed_max_tokens=engine.cfg.max_tokens,
        eos_ids=tuple(sorted(engine.tokenizer.eos_ids)),
    )
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or rid
    created = int(time.time())
    fp = f"imp-{engine.runner.fingerprint[:12]}"
    splitters = [ThinkSplitter(thinking) for _ in range(gen.n)]
    with live_requests(request).track(rid, request.get("client_request_id"),
                                      lambda: any(s.thinking for s in splitters)):
        async with contextlib.aclosing(generate(engine, rid, prompt, gen, endpoint="chat_completions")) as deltas:
            if not gen.stream:
                return await _complete(request, engine, gen, deltas, rid, created, fp, len(prompt), splitters)
            return await _stream(request, engine, gen, deltas, rid, created, fp, len(prompt), splitters)


async def _complete(request, engine, gen, deltas, rid, created, fp, prompt_len, splitters) -> web.Response:
    tok = engine.tokenizer
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
                finish[d.index] = d.finish.openai()
            prompt_len, cached = d.prompt_tokens or prompt_len, d.cached_tokens
            completion[d.index] = d.completion_tokens
    except StreamFault as exc:  # nothing was sent yet: a plain 500
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    choices = []
    for i in range(gen.n):
        msg = {"role": "assistant", "content": texts[i]}
        if splitters[i].saw_think:
            msg["reasoning_content"] = msg["reasoning"] = thoughts[i]
        choices.append({
            "index": i,
            "message": msg,
            "logprobs": {"content": chat_content(tok, lps[i], gen.top_logprobs)} if gen.logprobs else None,
            "finish_reason": finish[i],
        })
    return web.json_response(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": engine.model_name,
            "system_fingerprint": fp,
            "choices": choices,
            "usage": usage_json(prompt_len, sum(completion), cached),
        },
        headers={"X-Request-Id": request["response_id"]},
    )


async def _stream(request, engine, gen, deltas, rid, created, fp, prompt_len, splitters) -> web.StreamResponse:
    """Per-token SSE; the first chunk of each choice carries the role."""
    tok = engine.tokenizer
    resp = None
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
            "system_fingerprint": fp}

    def chunk(choices, usage=None) -> bytes:
        c = dict(base, choices=choices)
        if gen.include_usage:
            c["usage"] = usage
        return b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"

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
            completion[d.index] = d.completion_tokens
            prompt_tokens, cached = d.prompt_tokens or prompt_tokens, d.cached_tokens
            done = d.finish != FinishReason.NONE
            r, c = split_delta(splitters[d.index], d)
            if r or c or d.logprobs:
                delta = {}
                if r:
                    delta["reasoning_content"] = delta["reasoning"] = r
                if c or not r:
                    delta["content"] = c
                lp = {"content": chat_content(tok, d.logprobs, gen.top_logprobs)} if gen.logprobs else None
                await resp.write(chunk([{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": None}]))
            if done:
                await resp.write(chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": d.finish.openai()}]))
        usage = chunk([], usage_json(prompt_tokens, sum(completion), cached)) if gen.include_usage else None
        resp = await sse_end(request, resp, usage)
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, error_event, f"chat stream {rid}")
    return resp
