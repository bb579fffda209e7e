"""Models on demand over HTTP: the catalogue with what is resident, and the admin routes.

GET /v1/models lists every model of the fleet (imp.engine.fleet) with `loaded`, its resident bytes and
its context figures, the loaded models' LoRA adapters (their `parent` the base model) and the embedder.
POST /admin/models/load {"model": NAME} makes a model resident (unloading others if the budget says so);
POST /admin/models/unload {"model": NAME} drains its requests (never cancelled) and releases it.
"""

from __future__ import annotations

from aiohttp import web

from imp.engine.port import ModelRefused
from imp.http import keys
from imp.http.errors import ApiError, bad
from imp.http.pipeline import fields as B
from imp.http.pipeline.served import refusal


def entry(fleet, e) -> dict:
    """One model's row: resident or not, its bytes and its context figures."""
    m = fleet.models.get(e.name)  # an imp.engine.fleet.Model, or None: never loaded
    loaded = m is not None and m.loaded
    row = {"id": e.name, "object": "model", "created": e.created, "owned_by": "imp", "loaded": loaded,
           "size_bytes": e.size_bytes, "context_length": e.context_length}
    if e.aliases:
        row["aliases"] = list(e.aliases)
    if m is not None:
        card = m.engine.card
        row.update(context_length=card.context_length,
                   max_context_at_width_1=min(card.context_length, card.kv_blocks * card.block_size),
                   kv_capacity_tokens=card.kv_blocks * card.block_size * card.replicas)
    fp = m.footprint if loaded else None
    row["resident_bytes"] = (fp.device + fp.host) if fp else 0
    row["resident_device_bytes"] = fp.device if fp else 0
    row["resident_host_bytes"] = fp.host if fp else 0
    if m is not None:
        row["loads"] = m.loads
        row["last_load_seconds"] = round(m.load_seconds, 3)
    if fleet.swapping == e.name:
        row["loading"] = True
    return row


def adapters(fleet) -> list[dict]:
    out = []
    for m in fleet.models.values():
        if m.loaded:
            out += [{"id": a.name, "object": "model", "created": m.engine.card.created, "owned_by": "imp",
                     "parent": m.entry.name, "root": a.path, "lora_id": a.id} for a in m.engine.loras()]
    return out


def listing(request: web.Request, fleet, embedding: list[dict]) -> list[dict]:
    """fleet: the app's imp.engine.fleet.Fleet (duck-typed: HTTP sees the engine only through its port)."""
    return [*(entry(fleet, e) for e in fleet.catalog.entries), *adapters(fleet), *embedding]


def _fleet(request: web.Request):
    fleet = request.app.get(keys.FLEET)
    if fleet is None:
        raise ApiError(400, "this server serves one model: start it with --models-dir (or --models-file) to load "
                            "and unload models by name", code="models_not_enabled")
    return fleet


async def load(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    body = await B.read_json(request)
    name = B.model_name(body)
    try:
        m = await fleet.load(name)
    except ModelRefused as exc:
        raise refusal(exc) from None
    return web.json_response({**entry(fleet, m.entry), "loaded": True})


async def unload(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    body = await B.read_json(request)
    name = B.model_name(body)
    drain = body.get("drain_s")
    if drain is not None and (isinstance(drain, bool) or not isinstance(drain, (int, float)) or not 0 <= drain <= 3600):
        raise bad("'drain_s' must be a number of seconds in 0..3600", "drain_s")
    try:
        m = await fleet.unload(name, drain)
    except ModelRefused as exc:
        raise refusal(exc) from None
    return web.json_response({**entry(fleet, m.entry), "unloaded": True})
