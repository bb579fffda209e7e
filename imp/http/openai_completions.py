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
import logging
import time
import uuid

import msgspec
from aiohttp import web

from imp.http import body as B
from imp.http import keys, openai_fields, resolve, structured
from imp.http.control import live_requests
from imp.http.driver import KEEPALIVE_COMMENT, StreamFault, finish_label, generate, sse_start, stream_failed
from imp.http.errors import ApiError, bad
from imp.http.logprobs import CompletionLogprobs, merge, prompt_logprobs_json
from imp.http.openai_wire import error_event, fingerprint, sse_data, sse_end, usage_json
from imp.http.reasoning import ThinkSplitter, prompt_opens_think
from imp.http.request import GenerateRequest, Infill
from imp.messages import FinishReason

log = logging.getLogger("imp.http")


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def prompt_field(raw) -> tuple[tuple[int, ...] | None, str | None]:
    """The request's prompt as (token ids, None) or (None, text); 400 on anything else."""
    if raw is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(raw, list):
        if _is_ids(raw):
            return tuple(raw), None
        if len(raw) == 1 and (isinstance(raw[0], str) or _is_ids(raw[0])):
            return prompt_field(raw[0])
        if len(raw) > 1 and (all(isinstance(p, str) for p in raw) or all(_is_ids(p) for p in raw)):
            raise bad("a batch of prompts is not supported: send one prompt per request", "prompt",
                      "batch_not_supported")
        raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
    if not isinstance(raw, str):
        raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
    return None, raw


def parse(body: dict, vocab_size: int) -> GenerateRequest:
    model = B.model_name(body)
    B.refuse_request_template(body)
    ids, text = prompt_field(body.get("prompt"))
    suffix = B.string(body, "suffix")
    echo = B.boolean(body, "echo")
    infill = None
    if suffix:  # "" is no suffix, as in OpenAI's API
        if echo:
            raise bad("'echo' cannot be combined with 'suffix'", "echo")
        infill = Infill(prompt=text or "", prompt_ids=ids, suffix=suffix)
    c = openai_fields.common(body)
    sampling = openai_fields.sampling(body, vocab_size)
    plp = openai_fields.prompt_logprobs(body, allowed=True, stream=c.stream)
    constraint, field = structured.parse(body, dialect="openai")
    lp = B.num(body, "logprobs", 0, 20, integer=True)
    if echo and lp is not None and c.stream:
        raise bad("'echo' with 'logprobs' cannot be used with 'stream': true", "echo")
    return GenerateRequest(
        endpoint="completions", model=model, prompt_text=text if infill is None else None,
        prompt_ids=ids if infill is None else None, infill=infill, prompt_param="prompt", sampling=sampling,
        max_tokens=c.max_tokens, n=c.n, stop=c.stop, stream=c.stream, include_usage=c.include_usage,
        logprobs=lp is not None, top_logprobs=lp or 0, prompt_logprobs=plp, echo=echo, priority=c.priority,
        cache_prompt=c.cache_prompt, session_id=c.session_id, lora=c.lora, constraint=constraint, constraint_field=field,
    )


async def completions(request: web.Request) -> web.StreamResponse:
    port, tm, cfg = request.app[keys.PORT], request.app[keys.TEXT], request.app[keys.CONFIG]
    req = parse(await B.read_json(request), tm.tokenizer.vocab_size)
    await resolve.compile_constraint(req, request.app[keys.GRAMMARS])
    prompt = await resolve.render_off_loop(req, tm, port.card)
    params = resolve.sampling_params(req, len(prompt.ids), port.card, tm, cfg.max_tokens, cfg.max_output_tokens)
    if req.echo and req.logprobs:
        # the echoed prompt's logprobs come from the same prompt scoring as prompt_logprobs
        params = msgspec.structs.replace(params, prompt_logprobs=max(req.top_logprobs, req.prompt_logprobs))
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or rid
    ctx = _Ctx(port, tm, req, rid, prompt.ids, prompt.text)
    # for end_thinking: follow the think state of choice 0's text
    think = ThinkSplitter(prompt_opens_think(prompt.text[-64:]))
    with live_requests(request).track(rid, request.get("client_request_id"), lambda: think.thinking):
        async with contextlib.aclosing(generate(port, rid, prompt.ids, params, req, request=request,
                                                keepalive=req.stream)) as deltas:
            if req.stream:
                return await _stream(request, ctx, deltas, think)
            return await _complete(request, ctx, deltas, think)


class _Ctx:
    def __init__(self, port, tm, req: GenerateRequest, rid, prompt, prompt_text):
        self.tok, self.gen, self.rid, self.prompt, self.prompt_text, self.echo = \
            tm.tokenizer, req, rid, prompt, prompt_text, req.echo
        gen, echo = req, req.echo
        self.created = int(time.time())
        self.base = {"id": rid, "object": "text_completion", "created": self.created,
                     "model": port.card.name, "system_fingerprint": fingerprint(port.card)}
        tok = tm.tokenizer
        start = len(prompt_text) if echo else 0
        self.lp = [CompletionLogprobs(tok, gen.top_logprobs, 0 if echo and gen.logprobs else start)
                   for _ in range(gen.n)]


async def _complete(request, ctx: _Ctx, deltas, think) -> web.Response:
    gen, tok = ctx.gen, ctx.tok
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
                finish[d.index] = finish_label(d.finish)
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
        return sse_data(c)

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
            if d is None:  # queued or prefilling: an SSE comment now and then (clients skip comments)
                await resp.write(KEEPALIVE_COMMENT)
                continue
            if d.index == 0:
                think.push(d.text)
            completion[d.index] = d.completion_tokens
            prompt_tokens, cached = d.prompt_tokens or prompt_tokens, d.cached_tokens
            if d.text or d.logprobs:
                lp = ctx.lp[d.index].entries(d.logprobs) if gen.logprobs else None
                await resp.write(chunk([{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": None}]))
            if d.finish != FinishReason.NONE:
                await resp.write(chunk([{"index": d.index, "text": "", "logprobs": None,
                                         "finish_reason": finish_label(d.finish)}]))
        usage = chunk([], usage_json(prompt_tokens, sum(completion), cached)) if gen.include_usage else None
        resp = await sse_end(request, resp, usage)
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: see stream_failed
        await stream_failed(exc, resp, error_event, f"completion stream {ctx.rid}")
    return resp
