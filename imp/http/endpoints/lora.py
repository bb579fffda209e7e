"""Admin routes for LoRA adapters: POST /admin/lora/load, POST /admin/lora/unload, GET /admin/lora.

Thin: the body is checked here, the engine port loads (path confined to --lora-dir,
shapes checked against the model, on every replica) and answers LoraInfo or
LoraRefused with the reference's status codes:
    load    200 {id, name, path, loaded: true} · 400 lora_load_failed (missing path,
            not a PEFT adapter, a pickle, wrong shapes, outside --lora-dir) · 400 a bad
            body · 409 lora_already_loaded · 409 suspended / engine faulted
    unload  200 {id, name, unloaded: true} · 404 lora_not_found · 400 neither an integer
            id nor a string name · 503 lora_busy (its requests did not finish in time)
A request selects one with `"lora": "name"` on any dialect (or a `model` equal to its
name); an unknown name is 400 lora_not_loaded.
"""

from __future__ import annotations

from aiohttp import web

from imp.engine.port import LoraRefused
from imp.http import keys
from imp.http.pipeline.fields import read_json
from imp.http.pipeline.served import served
from imp.http.errors import ApiError, bad


def _refused(exc: LoraRefused) -> ApiError:
    return ApiError(exc.status, exc.message, code=exc.code)


def _info(a) -> dict:
    return {"id": a.id, "name": a.name, "path": a.path, "bytes": a.nbytes}


async def load(request: web.Request) -> web.Response:
    body = await read_json(request)
    path, name = body.get("path"), body.get("name")
    if not isinstance(path, str) or not path:
        raise bad("'path' is required: a PEFT adapter directory or a .safetensors file under --lora-dir", "path")
    if name is not None and (not isinstance(name, str) or not name or len(name) > 256):
        raise bad("'name' must be a non-empty string", "name")
    base = body.get("model")  # models on demand: the base model it belongs to (default: the boot model)
    if base is not None and (not isinstance(base, str) or not base):
        raise bad("'model' must be the name of the base model (GET /v1/models)", "model")
    try:
        async with served(request, base) as model:  # resident while it loads (its shapes are checked against it)
            info = await model.port.lora_load(path, name)
            return web.json_response({**_info(info), "loaded": True, "model": model.port.card.name})
    except LoraRefused as exc:
        raise _refused(exc) from None


def _ports(request: web.Request) -> list:
    """Every engine that may hold adapters: the fleet's resident models, else the one engine."""
    fleet = request.app.get(keys.FLEET)
    if fleet is None:
        return [request.app[keys.PORT]]
    return fleet.ports()


async def unload(request: web.Request) -> web.Response:
    body = await read_json(request)
    lid, name = body.get("id"), body.get("name")
    if isinstance(lid, bool) or not (isinstance(lid, int) or (lid is None and isinstance(name, str) and name)):
        raise bad("give the adapter's integer 'id' or its string 'name'", "id")
    ports = _ports(request)
    if len(ports) > 1:  # each model numbers its own adapters: pick the one that has it
        base = body.get("model")
        held = [p for p in ports if (lid is not None and any(a.id == lid for a in p.loras()))
                or (lid is None and p.lora_named(name) is not None)]
        if base is not None:
            held = [p for p in held if p.card.name == base]
        if len(held) > 1:
            raise bad(f"adapter {lid if lid is not None else name!r} is loaded on several models "
                      f"({', '.join(p.card.name for p in held)}): name the base model in 'model'", "model")
        ports = held or ports[:1]
    try:
        info = await ports[0].lora_unload(lid, name if lid is None else None)
    except LoraRefused as exc:
        raise _refused(exc) from None
    return web.json_response({"id": info.id, "name": info.name, "unloaded": True})


async def listing(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{**_info(a), "model": p.card.name}
                                                         for p in _ports(request) for a in p.loras()]})
