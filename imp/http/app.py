"""The aiohttp application: factory, middlewares, the routes table wired in.

Handlers are thin: they parse, call the engine port, render. Domain errors
arrive as ApiError and leave as a JSON envelope in the route's dialect;
every response echoes X-Request-Id. Dependencies are injected here
(`imp.http.keys`), never imported by the handlers.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid

from aiohttp import web

from imp.http import keys
from imp.http.access import RateLimiter, key_matches, presented_key, retry_after
from imp.http.closing import Closing, closing_mw
from imp.http.endpoints.control import serve_peers
from imp.http.pipeline.live import LiveRequests
from imp.http.errors import ApiError, error_response
from imp.http.routes import ROUTES

log = logging.getLogger("imp.http")

_SAFE = re.compile(r"[^\x21-\x7e]")
_OPEN = {"/health", "/ready"}  # probes never need the key
BODY_LIMIT = 32 * 1024 * 1024


def _open_path(request: web.Request) -> bool:
    """Probes, and the chat UI's static page (it must load to ask for the key)."""
    p = request.path
    return p in _OPEN or (request.method in ("GET", "HEAD") and (p == "/" or p.startswith("/ui/")))


def client_request_id(request: web.Request) -> str | None:
    raw = request.headers.get("X-Request-Id")
    if not raw:
        return None
    rid = _SAFE.sub("", raw)[:128]
    return rid or None


@web.middleware
async def context_mw(request: web.Request, handler):
    rid = client_request_id(request)
    request["client_request_id"] = rid
    request["request_id"] = rid or f"req-{uuid.uuid4().hex[:24]}"
    try:
        resp = await handler(request)
    except ApiError as err:
        resp = error_response(request, err, request["request_id"])
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        msg = {404: f"no route {request.method} {request.path}", 405: f"method {request.method} not allowed on {request.path}"}.get(
            exc.status, exc.reason
        )
        if exc.status == 413:
            msg = "request body too large"
        resp = error_response(request, ApiError(exc.status, msg, code="not_found" if exc.status == 404 else None), request["request_id"])
    except Exception:  # noqa: BLE001 - our fault: log it, answer 500, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        resp = error_response(request, ApiError(500, "internal error", code="internal_error"), request["request_id"])
    if not resp.prepared:
        resp.headers["X-Request-Id"] = request.get("response_id") or request["request_id"]
        if request.path.startswith("/v1/messages"):
            resp.headers["request-id"] = request["request_id"]
    return resp


def access_mw(api_keys: tuple[str, ...], rate_limit: int, rate=None):
    """API keys on every route but the probes, then the per-caller rate limit (imp.http.access).
    rate: async (caller) -> seconds to wait (0.0 = allowed), where the buckets live elsewhere
    (the engine process holds them for every API-server process); None: this process's own."""
    if rate is None and rate_limit:
        limiter = RateLimiter(rate_limit)

        async def rate(caller: str) -> float:
            return limiter.take(caller, time.monotonic())

    @web.middleware
    async def mw(request: web.Request, handler):
        if _open_path(request):
            return await handler(request)
        caller = request.remote or "?"
        if api_keys:
            key = key_matches(presented_key(request.headers), api_keys)
            if key is None:
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)",
                               code="invalid_api_key")
            caller = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        if rate_limit:
            wait = await rate(caller)
            if wait:
                raise ApiError(429, f"rate limit of {rate_limit} requests per minute reached; retry in {wait:.1f}s",
                               code="rate_limit_exceeded", headers={"Retry-After": retry_after(wait)})
        return await handler(request)

    return mw


def create_app(port, text, config, grammars=None, api_keys: tuple[str, ...] | None = None,
               rate=None, embedder=None, fleet=None) -> web.Application:
    """port: an imp.engine.port.EnginePort (started and stopped with the app);
    text: the imp.text.model.TextModel; config: the frozen imp.config.ServerConfig;
    grammars: the imp.constrain.compile.GrammarCache (None: constraints are refused);
    api_keys: every accepted key (read at boot from --api-key and --api-key-file; None:
    just config.api_key); rate: where --rate-limit's buckets are (see access_mw); embedder: the
    sentence-embedding model of --embedding-model (None: /v1/embeddings and /v1/rerank are 400s); fleet:
    the imp.engine.port.Models of --models-dir (port is then its boot model's), or None."""
    if api_keys is None:
        api_keys = (config.api_key,) if config.api_key else ()
    app = web.Application(middlewares=[context_mw, closing_mw(lambda r: r.path in _OPEN),
                                       access_mw(api_keys, config.rate_limit, rate)],
                          client_max_size=BODY_LIMIT)
    app[keys.CLOSING] = Closing()
    app[keys.PORT] = port
    app[keys.TEXT] = text
    app[keys.CONFIG] = config
    app[keys.LIVE] = LiveRequests()
    serve_peers(app)
    app[keys.GRAMMARS] = grammars
    app[keys.EMBEDDER] = embedder
    app[keys.FLEET] = fleet

    async def engine_ctx(app: web.Application):
        await port.start()
        if fleet is not None:
            await fleet.start()
        yield
        if fleet is not None:
            await fleet.stop()
        await port.stop()

    app.cleanup_ctx.append(engine_ctx)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app
