"""The Responses store: a finished response persisted (store: true), and the stored-response routes.

A store write that fails after the response was produced is logged and counted
(the store's write_failures) and the response says `"store": false`: the answer
the client got is still good, only it cannot be fetched again.
GET /v1/responses/{id}, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.
"""

from __future__ import annotations

import json
import logging

import msgspec
from aiohttp import web

from imp.http import keys
from imp.http.errors import ApiError, bad
from imp.messages import StoreItem

log = logging.getLogger("imp.http")
_enc = msgspec.json.Encoder()


def _canonical(item: dict) -> dict:
    """An input item as OpenAI lists it back: typed, with its text in content parts."""
    if "type" not in item and "role" in item:
        item["type"] = "message"
    if item.get("type") == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    return item


async def put(store, out) -> None:
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
