"""POST /v1/responses and the stored responses — the OpenAI Responses dialect (Codex, the Agents SDK).

A request goes through the shared path (typed request, resolver, driver); its
output becomes Response items: `reasoning` (a `<think>` block), `message`
(output_text), `function_call` (carrying its namespace when it has one),
`custom_tool_call` (Codex's apply_patch). Streaming follows the event contract
Codex and the SDK parse: response.created -> response.in_progress -> per item
output_item.added / content_part.added / deltas / .done events ->
response.completed (or .incomplete / .failed); every event has `type` and an
increasing `sequence_number`; item ids are the same in the stream and in the
final object; no [DONE]; a stream never ends without a terminal event.

`store: true` (the default) persists the response and its input items in the
store actor; `previous_response_id` continues a stored chain (the earlier turns
are rebuilt from the store, so their prompt prefix hits the prefix cache).
A store write that fails after the response was produced is logged and counted
(the store's write_failures) and the response says `"store": false`: the
answer the client got is still good, only it cannot be fetched again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

import msgspec
from aiohttp import web

from imp.http import body as B
from imp.http import keys, resolve
from imp.http.control import live_requests
from imp.http.driver import StreamFault, generate, sse_start, stream_failed
from imp.http.errors import ApiError, bad
from imp.http.reasoning import ThinkSplitter, split_delta
from imp.http.responses_request import ResponsesExtras, items_to_messages, parse
from imp.messages import FinishReason, StoreItem
from imp.tools import ArgsDelta, CallEnd, CallStart, Text

log = logging.getLogger("imp.http")
_enc = msgspec.json.Encoder()


def _hex() -> str:
    return uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- the response object


class _Out:
    """The response being built: its items (in output order) and figures; one per request."""

    def __init__(self, rid: str, model: str, ex: ResponsesExtras, created: int):
        self.rid, self.model, self.ex, self.created = rid, model, ex, created
        self.items: list[dict] = []
        self.status = "in_progress"
        self.error = None
        self.incomplete = None
        self.usage = None

    def obj(self) -> dict:
        ex = self.ex
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": self.status,
            "background": False, "error": self.error, "incomplete_details": self.incomplete,
            "instructions": ex.instructions, "max_output_tokens": ex.max_output_tokens, "model": self.model,
            "output": self.items, "parallel_tool_calls": ex.parallel_tool_calls,
            "previous_response_id": ex.previous_response_id,
            "reasoning": {"effort": (ex.reasoning or {}).get("effort"), "summary": (ex.reasoning or {}).get("summary")},
            "service_tier": "default", "store": ex.store, "temperature": ex.temperature,
            "text": {"format": ex.text_format or {"type": "text"}}, "tool_choice": ex.tool_choice_json,
            "tools": ex.tools_json, "top_p": ex.top_p, "truncation": "disabled", "usage": self.usage,
            "user": ex.user, "metadata": ex.metadata,
        }


def _usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _call_item(ex: ResponsesExtras, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    """A parsed call as its item: custom tools come back as custom_tool_call with their raw input."""
    if name in ex.custom:
        try:
            inp = json.loads(arguments or "{}").get("input", "")
        except (ValueError, AttributeError):
            inp = arguments
        item = {"type": "custom_tool_call", "id": f"ctc_{_hex()}", "call_id": call_id, "name": name,
                "input": inp if isinstance(inp, str) else json.dumps(inp), "status": status}
    else:
        item = {"type": "function_call", "id": f"fc_{_hex()}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}
    ns = ex.namespaces.get(name)
    if ns:
        item["namespace"] = ns
    return item


# --------------------------------------------------------------------------- handlers


async def create(request: web.Request) -> web.StreamResponse:
    port, tm, cfg = request.app[keys.PORT], request.app[keys.TEXT], request.app[keys.CONFIG]
    body = await B.read_json(request)
    store = port.store
    want_store = B.boolean(body, "store", True)
    if want_store and store is None:
        raise bad("'store': true needs the responses store, and this server runs without one "
                  "(--responses-store off): send store: false", "store")
    history = await _history(store, B.string(body, "previous_response_id"))
    req, ex = parse(body, tm.tokenizer.vocab_size, tm.template.source, history)
    await resolve.compile_constraint(req, request.app[keys.GRAMMARS])
    prompt = await resolve.render_off_loop(req, tm, port.card)
    params = resolve.sampling_params(req, len(prompt.ids), port.card, tm, cfg.max_tokens, cfg.max_output_tokens)
    rid = f"resp_{_hex()}"
    request["response_id"] = request.get("client_request_id") or rid
    out = _Out(rid, port.card.name, ex, int(time.time()))
    splitter = ThinkSplitter(prompt.opens_think)
    plan = req.tool_plan if req.tool_plan is not None and (req.tool_plan.active or ex.forced_custom) else None
    with live_requests(request).track(rid, request.get("client_request_id"), lambda: splitter.thinking):
        async with contextlib.aclosing(generate(port, rid, prompt.ids, params, req, request=request,
                                                keepalive=req.stream)) as deltas:
            run = _Run(out, splitter, plan, len(prompt.ids))
            if req.stream:
                return await _stream(request, run, deltas, store)
            return await _complete(request, run, deltas, store)


async def _history(store, prev: str | None) -> list:
    """The conversation behind previous_response_id, as template messages (oldest first)."""
    if not prev:
        return []
    if store is None:
        raise bad("'previous_response_id' needs the responses store, which this server runs without",
                  "previous_response_id")
    reply = await store.chain(prev)
    if not reply.ok:
        if reply.status == 404:
            raise ApiError(400, f"Previous response with id '{prev[:128]}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        raise ApiError(503 if reply.status == 503 else 500, f"responses store: {reply.error}",
                       code="store_unavailable")
    if reply.missing:
        raise ApiError(400, f"Previous response with id '{reply.missing[:128]}' (in the chain of '{prev[:128]}') "
                            "is no longer stored.", param="previous_response_id", code="previous_response_not_found")
    items: list[dict] = []
    for link in reply.chain:
        items += [json.loads(i.json) for i in link.input_items]
        items += [it for it in json.loads(link.response_json).get("output", []) if it.get("type") != "reasoning"]
    return items_to_messages(items, where="previous_response_id")


class _Run:
    """One generation's state as its deltas arrive: the think split, the text, the calls."""

    def __init__(self, out: _Out, splitter: ThinkSplitter, plan, prompt_len: int):
        self.out, self.splitter, self.plan, self.prompt_len = out, splitter, plan, prompt_len
        self.parser = plan.stream_parser() if plan is not None and not out.ex.forced_custom else None
        self.reasoning = ""
        self.text = ""
        self.completion = self.cached = self.reasoning_tokens = 0
        self.finish = FinishReason.NONE

    def take(self, d) -> tuple[str, str]:
        r, c = split_delta(self.splitter, d)
        self.prompt_len = d.prompt_tokens or self.prompt_len
        self.cached, self.completion = d.cached_tokens, d.completion_tokens
        if r and not c:
            self.reasoning_tokens += len(d.token_ids)
        self.reasoning += r
        self.text += c
        if d.finish != FinishReason.NONE:
            self.finish = d.finish
        return r, c

    @property
    def cut(self) -> bool:
        return self.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)

    def close(self) -> None:
        """Status and usage once the generation ended."""
        o = self.out
        o.usage = _usage(self.prompt_len, self.completion, self.cached, self.reasoning_tokens)
        if self.cut:
            o.status, o.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            o.status = "completed"


async def _complete(request, run: _Run, deltas, store) -> web.Response:
    out, ex = run.out, run.out.ex
    try:
        async for d in deltas:
            run.take(d)
    except StreamFault as exc:  # nothing was sent yet: a plain 500
        raise ApiError(500, f"engine step failed: {exc}", code="engine_step_failed") from None
    if run.splitter.saw_think:
        out.items.append({"type": "reasoning", "id": f"rs_{_hex()}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": run.reasoning}], "encrypted_content": None})
    if ex.forced_custom:
        out.items.append(_call_item(ex, f"call_{_hex()}", ex.forced_custom, json.dumps({"input": run.text})))
    else:
        text, calls = run.text, ()
        if run.plan is not None:
            parsed = run.plan.parse(run.text, cut=run.cut)
            text, calls = parsed.content, parsed.calls
        if text or not calls:
            # a reply max_output_tokens cut is an incomplete message, as OpenAI marks it
            out.items.append(_message_item(f"msg_{_hex()}", text, "incomplete" if run.cut else "completed"))
        out.items += [_call_item(ex, c.id, c.name, c.arguments) for c in calls]
    run.close()
    await _store(store, out)
    return web.json_response(out.obj(), headers={"X-Request-Id": request["response_id"]})


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """status in_progress: the streamed item as added (no content yet); completed / incomplete:
    its text."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _canonical(item: dict) -> dict:
    """An input item as OpenAI lists it back: typed, with its text in content parts."""
    if "type" not in item and "role" in item:
        item["type"] = "message"
    if item.get("type") == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    return item


async def _store(store, out: _Out) -> None:
    """Persist a finished response with its input items (store: true)."""
    ex = out.ex
    if not ex.store or store is None:
        return
    items = []
    for i, it in enumerate(ex.input_items):
        iid = it.get("id") if isinstance(it.get("id"), str) and it.get("id") else f"msg_{out.rid[5:]}{i:04d}"
        items.append(StoreItem(iid, _enc.encode(_canonical(dict(it, id=iid)))))
    reply = await store.put(out.rid, _enc.encode(out.obj()), tuple(items),
                            previous_response_id=ex.previous_response_id or "", created_at=float(out.created),
                            model=out.model)
    if not reply.ok:
        # the answer is good; it just cannot be fetched again: say so, never fail the request
        log.warning("responses store: %s not stored: %s", out.rid, reply.error)
        ex.store = False


# --------------------------------------------------------------------------- streaming


class _Events:
    """Event encoder: every event gets `type` and the next sequence_number."""

    def __init__(self):
        self.seq = 0

    def __call__(self, typ: str, **fields) -> bytes:
        data = {"type": typ, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {typ}\ndata: ".encode() + _enc.encode(data) + b"\n\n"


async def _stream(request, run: _Run, deltas, store) -> web.StreamResponse:
    out, ex = run.out, run.out.ex
    ev = _Events()
    resp = None  # started at the first delta: a refusal before it is still an HTTP status
    buf: list[bytes] = []
    cur: dict = {}  # the item being written: {"kind", "item", "index"}
    calls: dict[int, dict] = {}  # parser call index -> its item and output index

    def open_item(kind: str, item: dict) -> int:
        close_item()
        out.items.append(item)
        idx = len(out.items) - 1
        buf.append(ev("response.output_item.added", output_index=idx, item=dict(item)))
        cur.update(kind=kind, item=item, index=idx)
        if kind == "message":
            buf.append(ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return idx

    def close_item() -> None:
        if not cur:
            return
        item, idx, kind = cur["item"], cur["index"], cur["kind"]
        if kind == "reasoning":
            text = item["content"][0]["text"]
            buf.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                          text=text))
        elif kind == "message":
            text = item.pop("_text", "")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            buf.append(ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                          text=text, logprobs=[]))
            buf.append(ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                          part=part))
            item["content"], item["status"] = [part], "incomplete" if run.cut else "completed"
        elif kind == "custom":
            buf.append(ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                          input=item["input"]))
            item["status"] = "completed"
        buf.append(ev("response.output_item.done", output_index=idx, item=dict(item)))
        cur.clear()

    def reasoning(r: str) -> None:
        if cur.get("kind") != "reasoning":
            open_item("reasoning", {"type": "reasoning", "id": f"rs_{_hex()}", "summary": [],
                                    "content": [{"type": "reasoning_text", "text": ""}], "encrypted_content": None})
        item = cur["item"]
        item["content"][0]["text"] += r
        buf.append(ev("response.reasoning_text.delta", item_id=item["id"], output_index=cur["index"],
                      content_index=0, delta=r))

    def text(c: str) -> None:
        if not c:
            return
        if ex.forced_custom:
            if cur.get("kind") != "custom":
                open_item("custom", _call_item(ex, f"call_{_hex()}", ex.forced_custom, '{"input": ""}',
                                               "in_progress"))
            item = cur["item"]
            item["input"] += c
            buf.append(ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=cur["index"],
                          delta=c))
            return
        if cur.get("kind") != "message":
            open_item("message", _message_item(f"msg_{_hex()}", "", "in_progress"))
        item = cur["item"]
        item["_text"] = item.get("_text", "") + c
        buf.append(ev("response.output_text.delta", item_id=item["id"], output_index=cur["index"], content_index=0,
                      delta=c, logprobs=[]))

    def tool_events(events) -> None:
        for e in events:
            if isinstance(e, Text):
                text(e.text)
            elif isinstance(e, CallStart):
                item = _call_item(ex, e.id, e.name, "", "in_progress")
                if item["type"] == "custom_tool_call":
                    item["input"] = ""
                idx = open_item("call", item)
                calls[e.index] = {"item": item, "index": idx, "args": ""}
            elif isinstance(e, ArgsDelta):
                c = calls[e.index]
                c["args"] += e.text
                if c["item"]["type"] == "function_call":
                    buf.append(ev("response.function_call_arguments.delta", item_id=c["item"]["id"],
                                  output_index=c["index"], delta=e.text))
            elif isinstance(e, CallEnd):
                c = calls[e.index]
                item, idx = c["item"], c["index"]
                if item["type"] == "function_call":
                    item["arguments"] = c["args"]
                    buf.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  arguments=c["args"]))
                else:  # a custom tool's input arrives whole once its JSON closes
                    item["input"] = _call_item(ex, "", item["name"], c["args"])["input"]
                    buf.append(ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                  delta=item["input"]))
                    buf.append(ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                  input=item["input"]))
                item["status"] = "completed"
                buf.append(ev("response.output_item.done", output_index=idx, item=dict(item)))
                cur.clear()

    async def start() -> web.StreamResponse:
        r = await sse_start(request, request["response_id"])
        await r.write(ev("response.created", response=out.obj()) + ev("response.in_progress", response=out.obj()))
        return r

    try:
        async for d in deltas:
            if d is None:  # queued or prefilling: created + in_progress now, then in_progress again
                if resp is None:  # every few seconds (Codex hangs up after 300 s without an event)
                    resp = await start()
                else:
                    await resp.write(ev("response.in_progress", response=out.obj()))
                continue
            if resp is None:
                resp = await start()
            r, c = run.take(d)
            done = d.finish != FinishReason.NONE
            if r:
                reasoning(r)
            if run.parser is not None:
                tool_events(run.parser.push(c) + (run.plan.finish(run.parser, run.cut) if done else []))
            else:
                text(c)
            if buf:
                await resp.write(b"".join(buf))
                buf.clear()
        if resp is None:
            resp = await start()
        close_item()
        if not out.items:
            open_item("message", _message_item(f"msg_{_hex()}", "", "in_progress"))
            close_item()
        run.close()
        await _store(store, out)
        terminal = "response.completed" if out.status == "completed" else "response.incomplete"
        buf.append(ev(terminal, response=out.obj()))
        await resp.write(b"".join(buf))
    except Exception as exc:  # noqa: BLE001 - fault, disconnect or our bug: a failed terminal event
        def failed(message: str, code: str) -> bytes:
            out.status, out.error = "failed", {"code": code, "message": message}
            return ev("response.failed", response=out.obj())
        await stream_failed(exc, resp, failed, f"responses stream {out.rid}")
    return resp


# --------------------------------------------------------------------------- stored responses


def _store_or_404(request: web.Request):
    store = request.app[keys.PORT].store
    if store is None:
        raise ApiError(404, "this server runs without a responses store", code="not_found")
    return store


def _answer(reply, rid: str):
    if reply.ok:
        return None
    if reply.status == 404:
        raise ApiError(404, f"Response with id '{rid[:128]}' not found.", param="response_id", code="not_found")
    raise ApiError(503 if reply.status == 503 else 500, f"responses store: {reply.error}", code="store_unavailable")


async def retrieve(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    reply = await _store_or_404(request).get(rid)
    _answer(reply, rid)
    return web.Response(body=reply.response_json, content_type="application/json")


async def delete(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    reply = await _store_or_404(request).delete(rid)
    _answer(reply, rid)
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    q = request.query
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise bad("'limit' must be an integer", "limit") from None
    if not 1 <= limit <= 100:
        raise bad("'limit' must be in 1..100", "limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("'order' must be asc or desc", "order")
    reply = await _store_or_404(request).input_items(rid, after=q.get("after", ""), limit=limit, order=order)
    _answer(reply, rid)
    data = [json.loads(i.json) for i in reply.items]
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": reply.has_more})
