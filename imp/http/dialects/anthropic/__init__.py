"""POST /v1/messages and /v1/messages/count_tokens — the Anthropic Messages dialect.

Errors take Anthropic's shape (the error renderer picks it by path); every answer
carries `request-id` and echoes `anthropic-version` / `anthropic-beta`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from imp.http import keys
from imp.http.pipeline.served import served
from imp.http.dialects.anthropic.parse import parse as parse_body
from imp.http.dialects.anthropic.parse import TAKEN, render_prompt
from imp.http.dialects.anthropic.render import AnthropicRenderer
from imp.http.errors import ApiError, error_response
from imp.http.pipeline import fates, fields, resolve
from imp.http.pipeline.dialect import Base, ParseContext

log = logging.getLogger("imp.http")
_betas_seen: set[str] = set()


class Messages(Base):
    endpoint = "messages"
    id_prefix = "msg_"
    fields = TAKEN
    render_cls = AnthropicRenderer

    async def parse(self, body: dict, ctx: ParseContext):
        return parse_body(body, ctx.text.template.source), None

    def render_prompt(self, req, tm) -> resolve.Prompt:
        return render_prompt(req, tm)

    def unknown_message(self, name: str) -> str:
        return f"{name}: Extra inputs are not permitted"  # Anthropic's words


    def headers(self, request: web.Request) -> dict[str, str]:
        """request-id, and anthropic-version / anthropic-beta read and echoed, never enforced."""
        out = {"request-id": request["request_id"]}
        for h in ("anthropic-version", "anthropic-beta"):
            v = request.headers.get(h)
            if v:
                out[h] = v[:256]
        for beta in (b.strip() for b in out.get("anthropic-beta", "").split(",")):
            if beta and beta not in _betas_seen and len(_betas_seen) < 256:
                _betas_seen.add(beta)
                log.info("anthropic-beta %r is not implemented; ignored", beta)
        return out


DIALECT = Messages()


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's token count, rendered exactly as /v1/messages would render it."""
    headers = DIALECT.headers(request)
    try:
        body = await fields.read_json(request)
        async with served(request, body.get("model")) as model:
            resp = await _count(request, body, model, headers)
    except ApiError as err:
        resp = error_response(request, err, request["request_id"])
    resp.headers.update(headers)
    return resp


async def _count(request: web.Request, body: dict, model, headers: dict) -> web.Response:
    tm = model.text
    ignored = fates.sort(body, TAKEN, strict=request.app[keys.CONFIG].strict_fields,
                         unknown_message=DIALECT.unknown_message)
    if ignored:
        fates.say_once(ignored, "count_tokens", request.remote or "?")
        headers["imp-ignored-fields"] = fates.header(ignored)
    req = parse_body(body, tm.template.source, count_only=True)
    resolve.check_size(req, tm, model.port.card)
    prompt = await asyncio.to_thread(render_prompt, req, tm)
    return web.json_response({"input_tokens": len(prompt.ids)})
