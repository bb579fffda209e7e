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


def refusal(exc: ModelRefused) -> ApiError:
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after else None
    # OpenAI's own answer to an unknown model: 404, invalid_request_error, model_not_found (the Anthropic
    # routes map 404 to not_found_error)
    return ApiError(exc.status, exc.message, param="model" if exc.status == 404 else None, code=exc.code,
                    type="invalid_request_error" if exc.status == 404 else None, headers=headers)


@contextlib.asynccontextmanager
async def served(request: web.Request, name):
    """The Served model for the request's `model` (None or not a string: the boot model)."""
    app = request.app
    fleet = app.get(keys.FLEET)
    if fleet is None:
        yield Served(app[keys.PORT], app[keys.TEXT], app[keys.GRAMMARS])
        return
    name = name if isinstance(name, str) and name else fleet.first.entry.name
    timeout = app[keys.CONFIG].request_timeout_s
    try:
        lease = fleet.use(name, timeout)
        m = await lease.__aenter__()
    except ModelRefused as exc:
        raise refusal(exc) from None
    except asyncio.TimeoutError:
        raise ApiError(503, f"model {name[:128]!r} was not loaded within the request timeout ({timeout:g}s)",
                       code="model_swap_timeout", headers={"Retry-After": "5"}) from None
    try:
        yield Served(m.engine, m.text, m.grammars)
    finally:
        await lease.__aexit__(None, None, None)
