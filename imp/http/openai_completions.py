"""POST /v1/completions — the OpenAI legacy text-completion dialect.

prompt: a string, a token-id list, or a one-element list of either (a batch
is a 400, like the reference says). suffix turns the request into
fill-in-the-middle with the model's FIM tokens. echo prepends the prompt;
with logprobs it carries the prompt tokens' raw logprobs too, as does
prompt_logprobs (vLLM shape); neither can stream, both need every prompt row
forwarded, which the scheduler arranges (SamplingParams.prompt_logprobs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid

import msgspec
from aiohttp import web

from imp.http.app import ENGINE
from imp.http.control import live_requests
from imp.http.driver import StreamFault, generate, sse_end, sse_start, stream_failed
from imp.http.errors import ApiError, bad
from imp.http.fim import build_infill, model_fim
from imp.http.logprobs import CompletionLogprobs, merge, prompt_logprobs_json
from imp.http.openai_chat import error_event, read_json, usage_json
from imp.http.params import boolean, sampling, string
from imp.http.reasoning import ThinkSplitter, prompt_opens_think
from imp.messages import FinishReason

log = logging.getLogger("imp.http")


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def prompt_ids(tok, raw) -> tuple[list[int] | None, str | None]:
    """The request's prompt as (token ids, None) or (None, text); 400 on anything else."""
    if raw is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(raw, list):
        if _is_ids(raw):
            ids = raw
        elif len(raw) == 1 and (isinstance(raw[0], str) or _is_ids(raw[0])):
            return prompt_ids(tok, raw[0])
        elif len(raw) > 1 and (all(isinstance(p, str) for p in raw) or all(_is_ids(p) for p in raw)):
            raise bad("a batch of prompts is not supported: send one prompt per request", "prompt",
                      "batch_not_supported")
        else:
            raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
        bad_ids = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad_ids:
            raise bad(f"'prompt' token id {bad_ids[0]} is outside the vocabulary (0..{tok.vocab_size - 1})", "prompt")
        return list(ids), None
    if not isinstance(raw, str):
        raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
    return None, raw


def resolve_prompt(engine, body: dict) -> tuple[list[int], str]:
    """Token ids to run and the prompt's text (for echo)."""
    tok = engine.tokenizer
    ids, text = prompt_ids(tok, body.get("prompt"))
    suffix = string(body, "suffix")
    if suffix:  # "" is no suffix, as in OpenAI's API
        fim = model_fim(engine)
        if fim is None:
            raise bad("'suffix' needs fill-in-the-middle tokens and this model has none (no "
                      "tokenizer.ggml.fim_pre/suf/mid_token_id, no <fim_prefix>-style tokens)", "suffix",
                      "fim_not_supported")
        if boolean(body, "echo"):
            raise bad("'echo' cannot be combined with 'suffix'", "echo")
        prefix_text = text if text is not None else tok.decode(ids, skip_special=False)
        return build_infill(tok, fim, "", suffix, prompt_ids=ids if ids is not None else None,
                            prompt=text or ""), prefix_text
    if ids is None:
        # the whole prompt is the caller's: control-token spellings count (llama.cpp, vLLM)
        ids = tok.encode(text, add_special=True, parse_special=True)
    else:
        text = tok.decode(ids, skip_special=False)
    if not ids:
        raise bad("'prompt' is empty", "prompt")
    return ids, text


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json(request)
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise bad("'model' must be a string", "model")
    prompt, prompt_text = resolve_prompt(engine, body)
    gen = sampling(
        body, defaults=engine.defaults, vocab_size=engine.tokenizer.vocab_size, prompt_len=len(prompt),
        max_context=engine.max_context, fixed_max_tokens=engine.cfg.max_tokens,
        eos_ids=tuple(sorted(engine.tokenizer.eos_ids)), chat=False,
    )
    echo = boolean(body, "echo")
    if echo and gen.logprobs:
        if gen.stream:
            raise bad("'echo' with 'logprobs' cannot be used with 'stream': true", "echo")
        # the echoed prompt's logprobs come from the same prompt scoring as prompt_logprobs
        k = max(gen.top_logprobs, gen.prompt_logprobs)
        gen = dataclasses.replace(gen, params=msgspec.structs.replace(gen.params, prompt_logprobs=k))
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or rid
    ctx = _Ctx(engine, gen, rid, prompt, prompt_text, echo)
    # for end_thinking: follow the think state of choice 0's text
    think = ThinkSplitter(prompt_opens_think(prompt_text[-64:]))
    with live_requests(request).track(rid, request.get("client_request_id"), lambda: think.thinking):
        async with contextlib.aclosing(generate(engine, rid, prompt, gen, endpoint="completions")) as deltas:
            if gen.stream:
                return await _stream(request, ctx, deltas, think)
            return await _complete(request, ctx, deltas, think)


class _Ctx:
    def __init__(self, engine, gen, rid, prompt, prompt_text, echo):
        self.engine, self.gen, self.rid, self.prompt, self.prompt_text, self.echo = \
            engine, gen, rid, prompt, prompt_text, echo
        self.created = int(time.time())
        self.base = {"id": rid, "object": "text_completion", "created": self.created,
                     "model": engine.model_name, "system_fingerprint": f"imp-{engine.runner.fingerprint[:12]}"}
        tok = engine.tokenizer
        start = len(prompt_text) if echo else 0
        self.lp = [CompletionLogprobs(tok, gen.top_logprobs, 0 if echo and gen.logprobs else start)
                   for _ in range(gen.n)]


async def _complete(request, ctx: _Ctx, deltas, think) -> web.Response:
    gen, tok = ctx.gen, ctx.engine.tokenizer
    texts = [ctx.prompt_text if ctx.echo else ""] * gen.n
    lps: list[list] = [[] for _ in range(gen.n)]
    finish = ["stop"] * gen.n
    completion = [0] * gen.n
    prompt_len, cached, plp = len(ctx.prompt), 0, []
    try:
        async for d in deltas:
            if d.index == 0:
                think.push(d.text)
            texts[d.index] += d.text
            lps[d.index].extend(d.logprobs)
            plp = plp or list(d.prompt_logprobs)
            if d.finish != FinishReason.NONE:
                finish[d.index] = d.finish.openai()
            prompt_len, cached = d.prompt_tokens or prompt_len, d.cached_tokens
            completion[d.index] = d.completion_tokens
    except StreamFault as exc:
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    choices = []
    for i in range(gen.n):
        lp = None
        if gen.logprobs:
            lp = ctx.lp[i].entries(lps[i]) if not ctx.echo else \
                merge(ctx.lp[i].prompt(ctx.prompt, plp), ctx.lp[i].entries(lps[i]))
        c = {"index": i, "text": texts[i], "logprobs": lp, "finish_reason": finish[i]}
        if gen.prompt_logprobs >= 0:
            c["prompt_logprobs"] = prompt_logprobs_json(tok, ctx.prompt, plp, gen.prompt_logprobs)
        choices.append(c)
    return web.json_response(
        dict(ctx.base, choices=choices, usage=usage_json(prompt_len, sum(completion), cached)),
        headers={"X-Request-Id": request["response_id"]},
    )


async def _stream(request, ctx: _Ctx, deltas, think) -> web.StreamResponse:
    gen = ctx.gen
    resp = None

    def chunk(choices, usage=None) -> bytes:
        c = dict(ctx.base, choices=choices)
        if gen.include_usage:
            c["usage"] = usage
        return b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"

    completion = [0] * gen.n
    prompt_tokens, cached = len(ctx.prompt), 0
    try:
        async for d in deltas:
            if resp is None:
                resp = await sse_start(request, request["response_id"])
                if ctx.echo:
                    await resp.write(b"".join(
                        chunk([{"index": i, "text": ctx.prompt_text, "logprobs": None, "finish_reason": None}])
                        for i in range(gen.n)))
            if d.index == 0:
                think.push(d.text)
            completion[d.index] = d.completion_tokens
            prompt_tokens, cached = d.prompt_tokens or prompt_tokens, d.cached_tokens
            if d.text or d.logprobs:
                lp = ctx.lp[d.index].entries(d.logprobs) if gen.logprobs else None
                await resp.write(chunk([{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": None}]))
            if d.finish != FinishReason.NONE:
                await resp.write(chunk([{"index": d.index, "text": "", "logprobs": None,
                                         "finish_reason": d.finish.openai()}]))
        usage = chunk([], usage_json(prompt_tokens, sum(completion), cached)) if gen.include_usage else None
        resp = await sse_end(request, resp, usage)
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, error_event, f"completion stream {ctx.rid}")
    return resp
