"""POST /v1/embeddings (OpenAI) and POST /v1/rerank, /rerank (Cohere / Jina / vLLM shape).

Both need the sentence-embedding model the server was started with (`--embedding-model`,
injected as app[keys.EMBEDDER]: `name`, `hidden`, `max_tokens`, `tokenize(texts)`,
`embed(id lists) -> [B, H] float32`). Without one they are a 400 that says how to load it.

The encoder is a bi-encoder (all-MiniLM-L6-v2: mean pooling, unit vectors), so a rerank score
is the cosine similarity of the query's and the document's embeddings, in [-1, 1]; it orders
documents as that model ranks them, but it is not a cross-encoder's relevance probability.

Every field is honoured or refused: `encoding_format` float | base64, `dimensions` only at the
model's own width (it cannot be shortened honestly), text inputs only (token ids from another
tokenizer mean nothing to this one), and an input longer than the model's `max_seq_length` is
a 400 naming it, never a silent cut. The model runs on one worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import time
import uuid

import numpy as np
from aiohttp import web

from imp.http.pipeline import fields as B
from imp.http import keys
from imp.http.errors import ApiError, bad
from imp.messages import RequestStats

MAX_INPUTS = 2048  # OpenAI's limit per request
MAX_TOKENS = 300_000  # summed over a request's inputs (OpenAI's limit)
EMBED_SLICE, SLICE_TOKENS = 64, 4096  # inputs / tokens handed to the worker at a time (~0.8 s on 2 cores)
_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embed")  # one model run at a time


def _embedder(request: web.Request):
    e = request.app.get(keys.EMBEDDER)
    if e is None:
        raise bad("no embedding model is loaded: start the server with --embedding-model all-minilm-l6-v2 "
                  "(or a sentence-transformers folder)", "model", "model_not_loaded")
    return e


# fields other servers' embedding routes take that this one cannot honour: a 400, not a quiet no-op
_REFUSED = {
    "truncate_prompt_tokens": "inputs are never cut here: send at most the model's max_seq_length tokens",
    "truncate": "inputs are never cut here: send at most the model's max_seq_length tokens",
    "truncation_direction": "inputs are never cut here",
    "prompt_name": "no prompt templates for the embedding model",
    "instruction": "no instruction prefixes for the embedding model",
}


def _refuse_unsupported(body: dict) -> None:
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported: {why}", name, "unsupported_parameter")
    if body.get("normalize") is not None and body.get("normalize") is not True:
        raise bad("'normalize': this model's vectors are unit-normalized (its Normalize module); only true", "normalize",
                  "unsupported_parameter")


async def _start(request: web.Request) -> tuple[dict, object]:
    """Both routes' first checks: the body, a loaded embedder, `model`, the fields refused here."""
    body = await B.read_json(request)
    e = _embedder(request)
    B.model_name(body)
    _refuse_unsupported(body)
    return body, e


def _texts(v, name: str) -> list[str]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items:
        raise bad(f"'{name}' must be a non-empty string or array of strings", name)
    if len(items) > MAX_INPUTS:
        raise bad(f"'{name}' has {len(items)} entries; at most {MAX_INPUTS} a request", name)
    for i, t in enumerate(items):
        if not isinstance(t, str):
            what = "token ids" if isinstance(t, (int, list)) else type(t).__name__
            raise bad(f"'{name}[{i}]': {what} are not accepted: this embedding model takes text (ids from "
                      "another tokenizer mean nothing to its own)", f"{name}[{i}]")
        if not t:
            raise bad(f"'{name}[{i}]' is an empty string", f"{name}[{i}]")
    return items


async def _encode(e, texts: list[str], name: str, offset: int = 0) -> tuple[np.ndarray, int]:
    """[len(texts), H] unit vectors and the tokens they took; an input over the model's length is a 400."""
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(_POOL, e.tokenize, texts)
    total = 0
    for i, x in enumerate(ids):
        if len(x) > e.max_tokens:
            where = f"{name}[{i + offset}]" if name != "query" else name
            raise bad(f"'{where}' is {len(x)} tokens; {e.name} embeds at most {e.max_tokens} (split the text)",
                      where, "input_too_long")
        total += len(x)
    if total > MAX_TOKENS:
        raise bad(f"'{name}' totals {total} tokens; at most {MAX_TOKENS} a request", name)
    # the model runs a slice at a time (similar lengths together): a client that hangs up stops
    # the work at the next slice instead of leaving the worker busy for the whole request
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = np.empty((len(ids), e.hidden), np.float32)
    s = 0
    while s < len(order):
        n, size = 0, 0
        while s + n < len(order) and n < EMBED_SLICE and (n == 0 or size + len(ids[order[s + n]]) <= SLICE_TOKENS):
            size += len(ids[order[s + n]])
            n += 1
        part = order[s:s + n]
        out[part] = await loop.run_in_executor(_POOL, e.embed, [ids[i] for i in part])
        s += n
    return out, total


def _reported(endpoint: str):
    """The handler's request, counted by the metrics actor (endpoint label, duration, prompt tokens)
    and traced, as the generation endpoints are: refusals with their status."""

    def wrap(handler):
        async def run(request: web.Request) -> web.Response:
            t0, arrival_ns = time.monotonic(), time.time_ns()
            status, tokens = 500, [0]
            try:
                resp = await handler(request, tokens)
                status = resp.status
                return resp
            except ApiError as exc:
                status = exc.status
                raise
            finally:
                port = request.app[keys.PORT]
                e = request.app.get(keys.EMBEDDER)
                port.report(RequestStats(
                    endpoint, status, tokens[0], duration_s=time.monotonic() - t0,
                    finish="stop" if status == 200 else "", request_id=request.get("request_id", ""),
                    client_request_id=request.get("client_request_id") or "",
                    model=e.name if e is not None else "", traceparent=request.headers.get("traceparent", "")[:128],
                    arrival_unix_ns=arrival_ns, end_unix_ns=time.time_ns()))

        return run

    return wrap


@_reported("embeddings")
async def embeddings(request: web.Request, tokens: list[int]) -> web.Response:
    body, e = await _start(request)
    texts = _texts(body.get("input"), "input")
    fmt = B.string(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = B.num(body, "dimensions", 1, integer=True)
    if dims is not None and dims != e.hidden:
        raise bad(f"'dimensions': {e.name} gives {e.hidden}-dimensional vectors and cannot shorten them",
                  "dimensions", "unsupported_parameter")
    B.string(body, "user")  # OpenAI's end-user id: a string when given (nothing here depends on it)
    vecs, tokens[0] = await _encode(e, texts, "input")
    data = []
    for i, v in enumerate(vecs):
        emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return web.json_response({"object": "list", "data": data, "model": e.name,
                              "usage": {"prompt_tokens": tokens[0], "total_tokens": tokens[0]}})


@_reported("rerank")
async def rerank(request: web.Request, tokens: list[int]) -> web.Response:
    body, e = await _start(request)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad("'query' must be a non-empty string", "query")
    docs = body.get("documents")
    if not isinstance(docs, list):
        raise bad("'documents' must be a non-empty array of strings or {\"text\": ...} objects", "documents")
    for i, d in enumerate(docs):  # Cohere and Jina also take {"text": ...} objects
        if isinstance(d, dict):
            if not isinstance(d.get("text"), str):
                raise bad(f"'documents[{i}]' is an object without a 'text' string", f"documents[{i}]")
            docs[i] = d["text"]
    texts = _texts(docs, "documents")
    top_n = B.num(body, "top_n", 1, integer=True)
    keep_docs = B.boolean(body, "return_documents", True)
    q, qt = await _encode(e, [query], "query")
    d, dt = await _encode(e, texts, "documents")
    tokens[0] = qt + dt
    qv = q[0] / max(float(np.linalg.norm(q[0])), 1e-12)
    dv = d / np.maximum(np.linalg.norm(d, axis=-1, keepdims=True), 1e-12)
    scores = dv @ qv
    order = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))[:top_n or len(texts)]
    results = []
    for i in order:
        r = {"index": i, "relevance_score": float(scores[i])}
        if keep_docs:
            r["document"] = {"text": texts[i]}
        results.append(r)
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex[:24]}", "object": "rerank", "model": e.name,
                              "created": int(time.time()), "results": results,
                              "usage": {"prompt_tokens": qt + dt, "total_tokens": qt + dt}})
