"""Which model serves a request: the one its `model` names (models on demand), else the boot model.

Without --models-dir / --models-file there is one model and every name reaches it (as llama-server
answers; an adapter's name picks the adapter). With them the fleet (imp.engine.fleet) resolves the name,
loads the model if it must (the request waits, within its timeout) and holds a lease on it until the
request's last byte; a name that matches nothing is a 404 model_not_found in the route's dialect.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NamedTuple

from aiohttp import web

from imp.engine.port import ModelRefused
from imp.http import keys
from imp.http.errors import ApiError


class Served(NamedTuple):
    port: object  # imp.engine.port.EnginePort
    text: object  # imp.text.model.TextModel
    grammars: object  # imp.constrain.compile.GrammarCache, or None


class NotResident(Exception):
    """An estimate named a model that is not loaded: its answer says resident: false (it never loads one)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


async def not_resident(request: web.Request, name: str) -> dict:
    """The estimate of a request for a model that is not loaded: what the catalogue knows, nothing measured."""
    rows = await request.app[keys.FLEET].rows()
    row = next((r for r in rows if r["id"] == name or name in r.get("aliases", ())), {})
    return {"model": row.get("id", name), "resident": False, "prompt_tokens": None, "warm_tokens": 0,
            "cache_tier": "miss", "need_blocks": None, "need_bytes": None, "fits_now": False, "fits_drained": None,
            "context_ok": None, "context_limit": row.get("context_length"), "est_ttft_s": None}


def refusal(exc: ModelRefused) -> ApiError:
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after else None
    # OpenAI's own answer to an unknown model: 404, invalid_request_error, model_not_found (the Anthropic
    # routes map 404 to not_found_error)
    return ApiError(exc.status, exc.message, param="model" if exc.status == 404 else None, code=exc.code,
                    type="invalid_request_error" if exc.status == 404 else None, headers=headers)


@contextlib.asynccontextmanager
async def served(request: web.Request, name, load: bool = True):
    """The Served model for the request's `model` (None or not a string: the boot model). load=False (an
    estimate): a model that is not resident raises NotResident instead of loading."""
    app = request.app
    fleet = app.get(keys.FLEET)  # an imp.engine.port.Models, or None
    if fleet is None:
        yield Served(app[keys.PORT], app[keys.TEXT], app[keys.GRAMMARS])
        return
    name = name if isinstance(name, str) and name else fleet.default
    timeout = app[keys.CONFIG].request_timeout_s
    lease = fleet.serve(name, timeout, load)
    try:  # entered by hand: a refusal to enter is the request's answer, an error in the body is not a refusal
        got = await lease.__aenter__()
    except ModelRefused as exc:
        if not load and exc.code == "model_not_loaded":
            raise NotResident(name) from None
        raise refusal(exc) from None
    except asyncio.TimeoutError:
        raise ApiError(503, f"model {name[:128]!r} was not loaded within the request timeout ({timeout:g}s)",
                       code="model_swap_timeout", headers={"Retry-After": "5"}) from None
    try:
        yield Served(*got)
    finally:
        await lease.__aexit__(None, None, None)
