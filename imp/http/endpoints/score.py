"""POST /v1/score — decoder-only scoring in SGLang's shape (vLLM's generative scoring reads
the same fields): how likely each of the caller's label tokens is as the next token after
query + item, for every item, with no text generated.

Request: `query` (a string or token ids), `items` (a string, strings, or token-id lists: the
query's kind), `label_token_ids` (ids of this model's vocabulary), `apply_softmax` (false:
each label's probability under the whole vocabulary; true: softmax over the labels alone,
so a row sums to 1), `item_first` (the prompt is item + query), `model` (optional; this
model's name when given). Any other field is a 400 naming it: nothing is ignored.

A prompt is made as /v1/completions makes one: text joined as text and tokenized with the
model's BOS, control-token spellings counted; ids joined as ids. The reply is
`{"scores": [[p(label) for each label] for each item], "model", "usage", "object": "scoring"}`.

Each item is one engine request (the metrics count them under endpoint "score"); they run
concurrently, so the scheduler batches them and the prefix cache shares the query. The
request's one step reads the raw next-token distribution at the prompt's last position
(greedy, no bias: the host sampler's log-softmax, SamplingParams.score_ids); the token the
step draws is discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid

from aiohttp import web

from imp.http.pipeline import fields as B
from imp.http.pipeline.served import served
from imp.http.pipeline import resolve
from imp.http.pipeline.driver import StreamFault, generate
from imp.http.errors import ApiError, bad
from imp.http.pipeline.request import GenerateRequest
from imp.messages import SamplingParams

FIELDS = ("model", "query", "items", "label_token_ids", "apply_softmax", "item_first")
MAX_ITEMS = 512
MAX_LABELS = 1024


def _is_ids(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse(body: dict, vocab_size: int):
    """(query, items, labels, apply_softmax, item_first), each checked; 400s name the field."""
    for name in body:
        if name not in FIELDS:
            raise bad(f"'{name}' is not a /v1/score field (it takes {', '.join(FIELDS)})", name,
                      "unsupported_parameter")
    if body.get("model") is not None:
        B.model_name(body)
    query = body.get("query")
    if isinstance(query, str):
        kind = str
    elif _is_ids(query):
        kind = list
    else:
        raise bad("'query' must be a string or a list of token ids", "query")
    items = body.get("items")
    if isinstance(items, str) and kind is str:
        items = [items]
    if not isinstance(items, list) or not items:
        raise bad("'items' must be a non-empty string or array (strings, or token-id lists when 'query' is ids)",
                  "items")
    if len(items) > MAX_ITEMS:
        raise bad(f"'items' has {len(items)} entries; at most {MAX_ITEMS} a request", "items")
    for i, it in enumerate(items):
        if kind is str and not isinstance(it, str):
            raise bad(f"'items[{i}]' must be a string, as 'query' is", f"items[{i}]")
        if kind is list and not _is_ids(it):
            raise bad(f"'items[{i}]' must be a list of token ids, as 'query' is", f"items[{i}]")
        if not query and not it:
            raise bad(f"'items[{i}]' and 'query' are both empty: nothing to score", f"items[{i}]")
    labels = body.get("label_token_ids")
    if not _is_ids(labels) or not labels:
        raise bad("'label_token_ids' is required: a non-empty list of token ids", "label_token_ids")
    if len(labels) > MAX_LABELS:
        raise bad(f"'label_token_ids' has {len(labels)} ids; at most {MAX_LABELS}", "label_token_ids")
    for t in labels:
        if not 0 <= t < vocab_size:
            raise bad(f"'label_token_ids': {t} is outside the vocabulary (0..{vocab_size - 1})", "label_token_ids")
    return (query, items, tuple(labels), B.boolean(body, "apply_softmax"), B.boolean(body, "item_first"))


def probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """The labels' probabilities: under the whole vocabulary, or renormalized over the labels."""
    if not apply_softmax:
        return [math.exp(v) for v in logprobs]
    top = max(logprobs)
    e = [math.exp(v - top) for v in logprobs]
    s = sum(e)
    return [x / s for x in e]


async def score(request: web.Request) -> web.Response:
    body = await B.read_json(request)
    async with served(request, body.get("model")) as model:
        return await _score(request, body, model.port, model.text)


async def _score(request: web.Request, body: dict, port, tm) -> web.Response:
    query, items, labels, soft, item_first = parse(body, tm.tokenizer.vocab_size)
    reqs = []
    for i, it in enumerate(items):
        parts = (it, query) if item_first else (query, it)
        joined = parts[0] + parts[1]
        reqs.append(GenerateRequest(endpoint="score", model=body.get("model"), prompt_param=f"items[{i}]",
                                    prompt_text=joined if isinstance(joined, str) else None,
                                    prompt_ids=tuple(joined) if isinstance(joined, list) else None, max_tokens=1))
    prompts = []
    for r in reqs:  # every prompt checked before any runs: a bad item is a 400 with nothing spent
        p = await resolve.render_off_loop(r, tm, port.card)
        resolve.check_context(r, len(p.ids), port.card)
        prompts.append(p.ids)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0, score_ids=labels)
    base = request.get("client_request_id") or f"score-{uuid.uuid4().hex[:24]}"
    request["response_id"] = base

    async def one(i: int) -> list[float]:
        read = None
        async with contextlib.aclosing(generate(port, f"{base}-{i}", prompts[i], params, reqs[i],
                                                request=request)) as deltas:
            async for d in deltas:
                if d is not None and d.logprobs and read is None:
                    read = [lp for _, lp in d.logprobs[0].top]
        if read is None or len(read) != len(labels):
            raise ApiError(500, "the engine returned no label logprobs", code="engine_step_failed")
        return probabilities(read, soft)

    try:
        async with asyncio.TaskGroup() as tg:  # one failure cancels the rest
            tasks = [tg.create_task(one(i)) for i in range(len(items))]
    except* ApiError as group:
        raise group.exceptions[0] from None
    except* StreamFault as group:
        fault = group.exceptions[0]
        raise ApiError(500, fault.message, code=fault.code) from None
    n = sum(len(p) for p in prompts)
    return web.json_response({"scores": [t.result() for t in tasks], "model": port.card.name, "object": "scoring",
                              "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}})
