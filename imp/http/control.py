"""Control of running requests: POST /v1/requests/{id}/end_thinking.

Generation handlers register each live request under its completion id and
the client's X-Request-Id; the control route finds it there. Ending a think
block is the scheduler's job (EndThinking: the model's `</think>` appended
as forced tokens, the answer continues on the same KV); this module only
says which request and whether it is still in a think block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from imp.http import keys
from imp.http.errors import ApiError


@dataclass
class Live:
    req_id: str
    thinking: Callable[[], bool]  # is the reply (still) inside a think block?
    ended: bool = False


class LiveRequests:
    def __init__(self):
        self._by_id: dict[str, Live] = {}

    @contextlib.contextmanager
    def track(self, req_id: str, client_id: str | None, thinking: Callable[[], bool]):
        live = Live(req_id, thinking)
        ids = [req_id] + ([client_id] if client_id and client_id not in self._by_id else [])
        for i in ids:
            self._by_id[i] = live
        try:
            yield live
        finally:
            for i in ids:
                if self._by_id.get(i) is live:
                    del self._by_id[i]

    def get(self, some_id: str) -> Live | None:
        return self._by_id.get(some_id)


def live_requests(request: web.Request) -> LiveRequests:
    return request.app[keys.LIVE]


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
