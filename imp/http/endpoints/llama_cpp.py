"""llama.cpp-shaped routes: /tokenize, /detokenize, /props (/infill is a dialect: `imp.http.dialects.infill`).

Field names and response shapes follow llama.cpp's server so its clients
(editor plugins, the web UI) work unchanged; /tokenize also takes vLLM's
spelling (`prompt`, `add_special_tokens`).
"""

from __future__ import annotations

import asyncio

import msgspec

from aiohttp import web

from imp.http import keys
from imp.http.pipeline.served import served
from imp.http.errors import ApiError, bad
from imp.http.pipeline import fields as B

TOKENIZE_MAX_CHARS = 4 << 20


async def tokenize(request: web.Request) -> web.Response:
    body = await B.read_json(request)
    async with served(request, body.get("model")) as model:  # llama-swap's routes take `model` too
        return await _tokenize(body, model.port, model.text.tokenizer)


async def _tokenize(body: dict, port, tok) -> web.Response:
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
    body = await B.read_json(request)
    async with served(request, body.get("model")) as model:
        tok = model.text.tokenizer
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
