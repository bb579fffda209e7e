"""Models on demand over HTTP: the catalogue with what is resident, and the admin routes.

GET /v1/models lists every model of the fleet (`imp.engine.port.Models`) with `loaded`, its resident bytes
and its context figures, the loaded models' LoRA adapters (their `parent` the base model) and the embedder.
POST /admin/models/load {"model": NAME} makes a model resident (unloading others if the budget says so);
POST /admin/models/unload {"model": NAME[, "drain_s": S]} drains its requests (never cancelled) and releases it.
"""

from __future__ import annotations

from aiohttp import web

from imp.engine.port import ModelRefused
from imp.http import keys
from imp.http.errors import ApiError, bad
from imp.http.pipeline import fields as B
from imp.http.pipeline.served import refusal


def _fleet(request: web.Request):
    fleet = request.app.get(keys.FLEET)
    if fleet is None:
        raise ApiError(400, "this server serves one model: start it with --models-dir (or --models-file) to load "
                            "and unload models by name", code="models_not_enabled")
    return fleet


async def load(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    name = B.model_name(await B.read_json(request))
    try:
        return web.json_response(await fleet.load_row(name))
    except ModelRefused as exc:
        raise refusal(exc) from None


async def unload(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    body = await B.read_json(request)
    name = B.model_name(body)
    drain = body.get("drain_s")
    if drain is not None and (isinstance(drain, bool) or not isinstance(drain, (int, float)) or not 0 <= drain <= 3600):
        raise bad("'drain_s' must be a number of seconds in 0..3600", "drain_s")
    try:
        return web.json_response(await fleet.unload_row(name, drain))
    except ModelRefused as exc:
        raise refusal(exc) from None
