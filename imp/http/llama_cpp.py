"""llama.cpp-shaped routes: /infill, /tokenize, /detokenize, /props.

Field names and response shapes follow llama.cpp's server so its clients
(editor plugins, the web UI) work unchanged; /tokenize also takes vLLM's
spelling (`prompt`, `add_special_tokens`).
"""

from __future__ import annotations

import contextlib
import json
import uuid

from aiohttp import web

from imp.http.app import ENGINE
from imp.http.control import live_requests
from imp.http.driver import StreamFault, generate, sse_start
from imp.http.errors import ApiError, bad
from imp.http.fim import build_infill, model_fim
from imp.http.openai_chat import error_event, read_json
from imp.http.params import boolean, num, sampling, string
from imp.messages import FinishReason

_STOP_TYPE = {"stop": "eos", "length": "limit"}


def _text_field(body: dict, name: str) -> str:
    return string(body, name, "") or ""


def _extra(body: dict) -> list[dict]:
    v = body.get("input_extra")
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > 64:
        raise bad("'input_extra' must be an array of at most 64 {filename, text} objects", "input_extra")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict) or not isinstance(c.get("text", ""), str) \
                or not isinstance(c.get("filename", "tmp"), str):
            raise bad(f"'input_extra[{i}]' must be an object with string 'text' and 'filename'", "input_extra")
        out.append({"filename": c.get("filename", "tmp"), "text": c.get("text", "")})
    return out


def _settings(gen) -> dict:
    p = gen.params
    return {"n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "typical_p": p.typical_p, "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "seed": p.seed, "ignore_eos": p.ignore_eos, "stop": gen.stop}


async def infill(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    tok = engine.tokenizer
    body = await read_json(request)
    fim = model_fim(engine)
    if fim is None:
        raise bad("this model has no fill-in-the-middle tokens (no tokenizer.ggml.fim_pre/suf/mid_token_id, "
                  "no <fim_prefix>-style tokens)", None, "fim_not_supported")
    prompt = build_infill(tok, fim, _text_field(body, "input_prefix"), _text_field(body, "input_suffix"),
                          _text_field(body, "prompt"), _extra(body))
    n_predict = num(body, "n_predict", -1, integer=True, default=None)
    fields = {k: v for k, v in body.items() if k not in ("n", "prompt", "n_predict")}
    if n_predict is not None and n_predict != -1 and "max_tokens" not in body:
        fields["max_tokens"] = n_predict  # 0 is refused there: nothing to generate
    gen = sampling(fields, defaults=engine.defaults, vocab_size=tok.vocab_size, prompt_len=len(prompt),
                   max_context=engine.max_context, fixed_max_tokens=engine.cfg.max_tokens,
                   eos_ids=tuple(sorted(tok.eos_ids)), chat=False)
    if gen.prompt_logprobs >= 0 or gen.logprobs:
        raise bad("/infill does not return logprobs; use /v1/completions with 'suffix'", "logprobs")
    return_tokens = boolean(body, "return_tokens")
    rid = f"infill-{uuid.uuid4().hex[:24]}"
    request["response_id"] = request.get("client_request_id") or rid
    head = {"index": 0, "id_slot": 0, "model": engine.model_name}
    with live_requests(request).track(rid, request.get("client_request_id"), lambda: False):
        async with contextlib.aclosing(generate(engine, rid, prompt, gen, endpoint="infill")) as deltas:
            text, ids, finish, done = "", [], "stop", {}
            resp = None
            try:
                async for d in deltas:
                    text += d.text
                    ids += d.token_ids
                    if gen.stream and d.text:
                        resp = resp or await sse_start(request, request["response_id"])
                        part = dict(head, content=d.text, tokens=list(d.token_ids) if return_tokens else [],
                                    stop=False)
                        await resp.write(b"data: " + json.dumps(part, ensure_ascii=False).encode() + b"\n\n")
                    if d.finish != FinishReason.NONE:
                        finish = d.finish.openai()
                        done = {"tokens_predicted": d.completion_tokens, "tokens_evaluated": d.prompt_tokens,
                                "tokens_cached": d.cached_tokens}
            except StreamFault as exc:
                if resp is None:
                    raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
                await resp.write(error_event(f"engine fault: {exc}"))
                return resp
            final = dict(head, content="" if gen.stream else text, tokens=ids if return_tokens else [],
                         stop=True, stop_type=_STOP_TYPE.get(finish, "eos"), stopping_word="",
                         truncated=False, generation_settings=_settings(gen),
                         prompt=tok.decode(prompt, skip_special=False), id=rid, **done)
            if not gen.stream:
                return web.json_response(final, headers={"X-Request-Id": request["response_id"]})
            resp = resp or await sse_start(request, request["response_id"])
            await resp.write(b"data: " + json.dumps(final, ensure_ascii=False).encode() + b"\n\n")
            return resp


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    tok = engine.tokenizer
    body = await read_json(request)
    text = body.get("content", body.get("prompt"))
    if not isinstance(text, str):
        raise bad("'content' (or 'prompt') must be a string", "content")
    add_special = boolean(body, "add_special", boolean(body, "add_special_tokens", False))
    parse_special = boolean(body, "parse_special", True)  # llama.cpp's default: the text is the caller's
    with_pieces = boolean(body, "with_pieces")
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
    return web.json_response({"tokens": tokens, "count": len(ids), "max_model_len": engine.max_context})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    tok = engine.tokenizer
    body = await read_json(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("'tokens' must be an array of token ids", "tokens")
    out = [t for t in ids if not 0 <= t < tok.vocab_size]
    if out:
        raise bad(f"token id {out[0]} is outside the vocabulary (0..{tok.vocab_size - 1})", "tokens")
    text = tok.decode(ids, skip_special=False)
    return web.json_response({"content": text, "prompt": text})


async def props(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    tok, d = engine.tokenizer, engine.defaults
    piece = lambda i: tok.id_to_piece(i) if i is not None else ""  # noqa: E731
    params = {"n_predict": engine.cfg.max_tokens or -1, "temperature": d.temperature, "top_k": d.top_k or 50,
              "top_p": d.top_p, "min_p": d.min_p, "typical_p": 1.0, "repeat_penalty": d.repetition_penalty,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": -1, "ignore_eos": False,
              "stop": [], "n_probs": 0, "stream": False}
    return web.json_response({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": engine.max_context,
                                        "speculative": False, "is_processing": False, "params": params},
        "total_slots": engine.cfg.max_batch_size,
        "model_path": str(getattr(engine, "model_path", engine.model_name)),
        "model_alias": engine.model_name,
        "chat_template": engine.template.source,
        "bos_token": piece(tok.bos_id),
        "eos_token": piece(tok.eos_id),
        "n_ctx": engine.max_context,
        "modalities": {"vision": False, "audio": False},
        "build_info": "imp",
        "fim": model_fim(engine) is not None,
    })
