"""POST /v1/chat/completions — the OpenAI chat dialect."""

from __future__ import annotations

import contextlib
import json
import time
import uuid

from aiohttp import web

from imp.http.app import ENGINE
from imp.http.driver import StreamFault, generate, sse_start
from imp.http.errors import ApiError, bad
from imp.http.params import sampling
from imp.messages import FinishReason

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_MEDIA = {"image_url", "input_image", "image", "input_audio", "audio", "video", "video_url", "file"}


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
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


def prepare_prompt(engine, messages: list[dict], body: dict) -> list[int]:
    from imp.model.chat_template import TemplateError

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be an array", "tools")
    try:
        return engine.template.render_and_encode(
            engine.tokenizer, messages, add_generation_prompt=True, tools=tools or None
        )
    except TemplateError as exc:
        raise bad(f"chat template error: {exc}", "messages", "template_error") from None


def _token_entry(tok, tid: int, lp: float) -> dict:
    s = tok.decode([tid], skip_special=False)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def logprobs_json(tok, items, top_n: int) -> list[dict]:
    out = []
    for st in items:
        e = _token_entry(tok, st.token_id, st.logprob)
        e["top_logprobs"] = [_token_entry(tok, t, l) for t, l in st.top[:top_n]]
        out.append(e)
    return out


def usage_json(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json(request)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    messages = normalize_messages(body.get("messages"))
    prompt = prepare_prompt(engine, messages, body)
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
    async with contextlib.aclosing(generate(engine, rid, prompt, gen, endpoint="chat_completions")) as deltas:
        if not gen.stream:
            return await _complete(request, engine, gen, deltas, rid, created, fp, len(prompt))
        return await _stream(request, engine, gen, deltas, rid, created, fp, len(prompt))


async def _complete(request, engine, gen, deltas, rid, created, fp, prompt_len) -> web.Response:
    tok = engine.tokenizer
    texts = [""] * gen.n
    lps: list[list] = [[] for _ in range(gen.n)]
    finish = ["stop"] * gen.n
    completion = [0] * gen.n
    cached = 0
    try:
        async for d in deltas:
            texts[d.index] += d.text
            lps[d.index].extend(d.logprobs)
            if d.finish != FinishReason.NONE:
                finish[d.index] = d.finish.openai()
            prompt_len, cached = d.prompt_tokens or prompt_len, d.cached_tokens
            completion[d.index] = d.completion_tokens
    except StreamFault as exc:  # nothing was sent yet: a plain 500
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i]},
            "logprobs": {"content": logprobs_json(tok, lps[i], gen.top_logprobs)} if gen.logprobs else None,
            "finish_reason": finish[i],
        }
        for i in range(gen.n)
    ]
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


async def _stream(request, engine, gen, deltas, rid, created, fp, prompt_len) -> web.StreamResponse:
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
            if d.text or d.logprobs:
                lp = {"content": logprobs_json(tok, d.logprobs, gen.top_logprobs)} if gen.logprobs else None
                await resp.write(chunk([{"index": d.index, "delta": {"content": d.text}, "logprobs": lp, "finish_reason": None}]))
            if done:
                await resp.write(chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": d.finish.openai()}]))
        if resp is None:  # nothing at all came back (cannot normally happen)
            resp = await sse_start(request, request["response_id"])
        if gen.include_usage:
            await resp.write(chunk([], usage_json(prompt_tokens, sum(completion), cached)))
        await resp.write(b"data: [DONE]\n\n")
    except StreamFault as exc:
        err = {"error": {"message": f"engine fault: {exc}", "type": "server_error", "param": None, "code": "engine_faulted"}}
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
    except (ConnectionResetError, ConnectionError):
        pass  # client went away; generate()'s cleanup already cancelled the request
    return resp
