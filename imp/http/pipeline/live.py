"""The requests this process is generating, by completion id and by the client's X-Request-Id.

The pipeline registers each request for its lifetime; `POST /v1/requests/{id}/end_thinking`
(`imp.http.endpoints.control`) finds it here and asks whether it is inside a think block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from imp.http import keys


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
