"""Control of running requests: POST /v1/requests/{id}/end_thinking.

The pipeline registers each live request under its completion id and the
client's X-Request-Id (`imp.http.pipeline.live`); the control route finds it there. Ending a think
block is the scheduler's job (EndThinking: the model's `</think>` appended
as forced tokens, the answer continues on the same KV); this module only
says which request and whether it is still in a think block.
"""

from __future__ import annotations

from aiohttp import web

from imp.http import keys
from imp.http.errors import ApiError


def _end_thinking_here(app: web.Application, rid: str) -> tuple[int, dict] | None:
    """(status, body) for a request this process runs, None if it runs elsewhere or nowhere."""
    live = app[keys.LIVE].get(rid)
    if live is None:
        return None
    body = {"id": live.req_id, "object": "request.end_thinking"}
    if live.ended or not live.thinking():
        return 200, dict(body, ended=False, reason="not_thinking")
    if not app[keys.PORT].end_thinking(live.req_id, app[keys.TEXT].think_end):
        return 404, {"message": f"request '{rid[:128]}' has finished"}
    live.ended = True
    return 200, dict(body, ended=True)


def serve_peers(app: web.Application) -> None:
    """Answer other API-server processes' control calls for the requests this one runs."""
    async def handler(action: str, some_id: str):
        return _end_thinking_here(app, some_id) if action == "end_thinking" else None

    app[keys.PORT].serve_peers(handler)


async def end_thinking(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    got = _end_thinking_here(request.app, rid)
    if got is None:  # another API-server process may run it
        got = await request.app[keys.PORT].ask_peers("end_thinking", rid)
    if got is None:
        raise ApiError(404, f"no running request '{rid[:128]}'", param="id", code="request_not_found")
    status, body = got
    if status != 200:
        raise ApiError(status, body.get("message", ""), param="id", code="request_not_found")
    return web.json_response(body)


async def close_session(request: web.Request) -> web.Response:
    """POST /v1/sessions/{id}/close: release the session's pinned prompt now."""
    sid = request.match_info["id"]
    if len(sid) > 256 or not sid.isprintable():
        raise ApiError(400, "session id must be at most 256 printable characters", param="id")
    request.app[keys.PORT].close_session(sid)
    return web.json_response({"id": sid, "object": "session", "closed": True})
