"""Pieces of the OpenAI wire format shared by chat, completions and /infill."""

from __future__ import annotations

import msgspec

_enc = msgspec.json.Encoder()

KEEPALIVE_COMMENT = b": keep-alive\n\n"  # a stream's keep-alive: an SSE comment (every client skips them)


def usage_json(prompt: int, completion: int, cached: int, spec: dict | None = None) -> dict:
    u = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if spec:  # imp.http.pipeline.spec_usage
        u["completion_tokens_details"] = spec
    return u


def sse_data(obj) -> bytes:
    """One `data:` event (msgspec: UTF-8, no ASCII escaping, several times json.dumps' speed)."""
    return b"data: " + _enc.encode(obj) + b"\n\n"


def error_event(message: str, code: str = "engine_faulted") -> bytes:
    return sse_data({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def fingerprint(card) -> str:
    return f"imp-{card.fingerprint[:12]}"
