"""llama.cpp-shaped routes: /infill, /tokenize, /detokenize, /props.

Field names and response shapes follow llama.cpp's server so its clients
(editor plugins, the web UI) work unchanged; /tokenize also takes vLLM's
spelling (`prompt`, `add_special_tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import msgspec

from aiohttp import web

from imp.http import body as B
from imp.http import keys, openai_fields, resolve, structured
from imp.http.control import live_requests
from imp.http.driver import StreamFault, finish_label, generate, sse_start
from imp.http.errors import ApiError, bad
from imp.http.openai_wire import error_event, sse_data
from imp.http.request import GenerateRequest, Infill
from imp.messages import FinishReason

TOKENIZE_MAX_CHARS = 4 << 20

_STOP_TYPE = {"stop": "eos", "length": "limit"}


def _text_field(body: dict, name: str) -> str:
    return B.string(body, name, "") or ""


def _extra(body: dict) -> tuple[tuple[str, str], ...]:
    v = body.get("input_extra")
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > 64:
        raise bad("'input_extra' must be an array of at most 64 {filename, text} objects", "input_extra")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict) or not isinstance(c.get("text", ""), str) \
                or not isinstance(c.get("filename", "tmp"), str):
            raise bad(f"'input_extra[{i}]' must be an object with string 'text' and 'filename'", "input_extra")
        out.append((c.get("filename", "tmp"), c.get("text", "")))
    return tuple(out)


def _settings(req: GenerateRequest, p) -> dict:
    return {"n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "typical_p": p.typical_p, "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "seed": p.seed, "ignore_eos": p.ignore_eos, "stop": list(req.stop)}


def parse_infill(body: dict, vocab_size: int) -> GenerateRequest:
    """llama.cpp's /infill body (n_predict, input_prefix/suffix/extra) -> the typed request."""
    infill = Infill(prefix=_text_field(body, "input_prefix"), suffix=_text_field(body, "input_suffix"),
                    prompt=_text_field(body, "prompt"), extra=_extra(body))
    n_predict = B.num(body, "n_predict", -1, integer=True)
    if n_predict == 0:
        raise bad("'n_predict' must be -1 (no limit) or >= 1", "n_predict")
    c = openai_fields.common(body)
    if c.n > 1:
        raise bad("/infill generates one completion: 'n' must be 1", "n")
    if B.num(body, "logprobs", 0, 20, integer=True) is not None or body.get("prompt_logprobs") is not None:
        raise bad("/infill does not return logprobs; use /v1/completions with 'suffix'", "logprobs")
    mt = c.max_tokens if c.max_tokens is not None else (n_predict if n_predict not in (None, -1) else None)
    constraint, field = structured.parse(body, dialect="openai")  # llama.cpp's grammar / json_schema
    return GenerateRequest(endpoint="infill", model=B.string(body, "model"), infill=infill, prompt_param="prompt",
                           sampling=openai_fields.sampling(body, vocab_size), max_tokens=mt, stop=c.stop,
                           stream=c.stream, priority=c.priority, cache_prompt=c.cache_prompt,
                           session_id=c.session_id, lora=c.lora, constraint=constraint, constraint_field=field)


async def infill(request: web.Request) -> web.StreamResponse:
    port, tm, cfg = request.app[keys.PORT], request.app[keys.TEXT], request.app[keys.CONFIG]
    tok = tm.tokenizer
    body = await B.read_json(request)
    if tm.fim is None:  # before anything else: no field can make this model fill in the middle
        raise bad("this model has no fill-in-the-middle tokens (no tokenizer.ggml.fim_pre/suf/mid_token_id, "
                  "no <fim_prefix>-style tokens)", None, "fim_not_supported")
    req = parse_infill(body, tok.vocab_size)
    await resolve.compile_constraint(req, request.app[keys.GRAMMARS])
    prompt = (await resolve.render_off_loop(req, tm, port.card)).ids
    params = resolve.sampling_params(req, len(prompt), port.card, tm, cfg.max_tokens, cfg.max_output_tokens)
    return_tokens = B.boolean(body, "return_tokens")
    rid = f"infill-{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or rid
    head = {"index": 0, "id_slot": 0, "model": port.card.name}
    with live_requests(request).track(rid, request.get("client_request_id"), lambda: False):
        async with contextlib.aclosing(generate(port, rid, prompt, params, req, request=request)) as deltas:
            text, ids, finish, done = "", [], "stop", {}
            resp = None
            try:
                async for d in deltas:
                    text += d.text
                    ids += d.token_ids
                    if req.stream and d.text:
                        resp = resp or await sse_start(request, request["response_id"])
                        part = dict(head, content=d.text, tokens=list(d.token_ids) if return_tokens else [],
                                    stop=False)
                        await resp.write(sse_data(part))
                    if d.finish != FinishReason.NONE:
                        finish = finish_label(d.finish)
                        done = {"tokens_predicted": d.completion_tokens, "tokens_evaluated": d.prompt_tokens,
                                "tokens_cached": d.cached_tokens}
            except StreamFault as exc:
                if resp is None:
                    raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
                await resp.write(error_event(f"engine fault: {exc}"))
                return resp
            final = dict(head, content="" if req.stream else text, tokens=ids if return_tokens else [],
                         stop=True, stop_type=_STOP_TYPE.get(finish, "eos"), stopping_word="",
                         truncated=False, generation_settings=_settings(req, params),
                         prompt=tok.decode(prompt, skip_special=False), id=rid, **done)
            if not req.stream:
                return web.json_response(final, headers={"X-Request-Id": request["response_id"]})
            resp = resp or await sse_start(request, request["response_id"])
            await resp.write(sse_data(final))
            return resp


async def tokenize(request: web.Request) -> web.Response:
    port, tok = request.app[keys.PORT], request.app[keys.TEXT].tokenizer
    body = await B.read_json(request)
    text = body.get("content", body.get("prompt"))
    if not isinstance(text, str):
        raise bad("'content' (or 'prompt') must be a string", "content")
    add_special = B.boolean(body, "add_special", B.boolean(body, "add_special_tokens", False))
    parse_special = B.boolean(body, "parse_special", True)  # llama.cpp's default: the text is the caller's
    with_pieces = B.boolean(body, "with_pieces")
    ctx = port.card.context_length
    if len(text) > TOKENIZE_MAX_CHARS:
        # the tokenizer's result and its JSON are built in single C calls that hold the GIL:
        # a 10 MB text would stall every stream for seconds even from a worker thread
        raise ApiError(413, f"'content' has {len(text)} characters; /tokenize takes at most "
                            f"{TOKENIZE_MAX_CHARS} per request (split the text)", param="content",
                       code="request_too_large")

    def work() -> bytes:
        ids = tok.encode(text, add_special=add_special, parse_special=parse_special)
        if with_pieces:
            tokens = []
            for i in ids:
                b = tok.piece_bytes(i)
                try:
                    piece = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)  # half a character: the bytes, as llama.cpp does
                tokens.append({"id": i, "piece": piece})
        else:
            tokens = ids
        # the list in slices: each encode is one GIL-holding call, so the loop gets turns between them
        parts = [msgspec.json.encode(tokens[i:i + 65536])[1:-1] for i in range(0, len(tokens), 65536)]
        return (b'{"tokens":[' + b",".join(parts) + b'],"count":' + str(len(ids)).encode()
                + b',"max_model_len":' + str(ctx).encode() + b"}")

    # a worker thread: tokenizing a 10 MB text and encoding its answer take seconds; the
    # event loop keeps serving every other request and stream meanwhile
    return web.Response(body=await asyncio.to_thread(work), content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    tok = request.app[keys.TEXT].tokenizer
    body = await B.read_json(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("'tokens' must be an array of token ids", "tokens")
    out = [t for t in ids if not 0 <= t < tok.vocab_size]
    if out:
        raise bad(f"token id {out[0]} is outside the vocabulary (0..{tok.vocab_size - 1})", "tokens")
    text = tok.decode(ids, skip_special=False)
    return web.json_response({"content": text, "prompt": text})


async def props(request: web.Request) -> web.Response:
    card, tm, cfg = request.app[keys.PORT].card, request.app[keys.TEXT], request.app[keys.CONFIG]
    tok, d = tm.tokenizer, tm.defaults
    piece = lambda i: tok.id_to_piece(i) if i is not None else ""  # noqa: E731
    params = {"n_predict": cfg.max_tokens or -1, "temperature": d.temperature, "top_k": d.top_k or 50,
              "top_p": d.top_p, "min_p": d.min_p, "typical_p": 1.0, "repeat_penalty": d.repetition_penalty,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": -1, "ignore_eos": False,
              "stop": [], "n_probs": 0, "stream": False}
    return web.json_response({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": card.context_length,
                                        "speculative": False, "is_processing": False, "params": params},
        "total_slots": card.max_batch_size * card.replicas,
        "model_path": card.path or card.name,
        "model_alias": card.name,
        "chat_template": tm.template.source,
        "bos_token": piece(tok.bos_id),
        "eos_token": piece(tok.eos_id),
        "n_ctx": card.context_length,
        "modalities": {"vision": False, "audio": False},
        "build_info": "imp",
        "fim": tm.fim is not None,
    })
