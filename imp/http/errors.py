"""Errors as JSON envelopes, in the dialect of the route that failed.

Handlers raise ApiError; the middleware renders it. A client mistake is
always a 4xx with a message that names the field; only our own faults are
5xx.
"""

from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger("imp.http")

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, err: ApiError, request_id: str | None = None) -> dict:
    if is_anthropic_path(path):
        body = {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error"), "message": err.message},
        }
        if request_id:
            body["request_id"] = request_id
        return body
    return {
        "error": {
            "message": err.message,
            "type": err.type or _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def error_response(request: web.Request, err: ApiError, request_id: str | None = None) -> web.Response:
    if 400 <= err.status < 500:
        # one WARN line per refusal: enough to debug a client, never a stack trace
        log.warning("HTTP %d %s %s: %s", err.status, request.method, request.path, err.message)
    resp = web.json_response(error_body(request.path, err, request_id), status=err.status)
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp
