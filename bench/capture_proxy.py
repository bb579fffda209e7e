"""A tiny capturing reverse proxy: see exactly what an agent CLI sends.

    .venv/bin/python bench/capture_proxy.py --port 9100 --upstream http://127.0.0.1:8000 \
        --out /tmp/claude.jsonl

Every request becomes two JSONL records with the same `seq`: `"phase": "request"`
as soon as it arrives (method, path, query, headers, the body — parsed JSON when
it is JSON, else text — and its size), then `"phase": "done"` with all of that
plus the upstream's status, content type, headers, the first and last 4 KB of its
answer and the time to its first byte (streams are relayed chunk by chunk, so a client
sees SSE as it is produced). A client that hangs up mid-answer is recorded as
`"client_disconnected": true`, and the upstream request is dropped with it (so
the server sees the disconnect too). Without --upstream the
proxy answers 404 itself in the OpenAI/Anthropic error shape, which is enough to
capture a client's first request. `--dump-dir DIR` also writes each JSON body
to DIR/NNNN-<path>.json (a fixture to replay).

Nothing is redacted: point it only at local test clients.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import time
from pathlib import Path

import aiohttp
from aiohttp import web

HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
       "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"}
HEAD_BYTES = 4096  # the answer's first and last bytes are kept (a stream's terminal events are at its end)
_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)

OUT_KEY = web.AppKey("out", Path)
DUMP_KEY = web.AppKey("dump", object)
UPSTREAM_KEY = web.AppKey("upstream", object)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
SEQ_KEY = web.AppKey("seq", itertools.count)


def _body_value(raw: bytes, ctype: str):
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")


def _write(app: web.Application, record: dict) -> None:
    with app[OUT_KEY].open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


async def handle(request: web.Request) -> web.StreamResponse:
    app = request.app
    seq = next(app[SEQ_KEY])
    raw = await request.read()
    record = {
        "seq": seq,
        "time": time.time(),
        "method": request.method,
        "path": request.path,
        "query": dict(request.query),
        "headers": dict(request.headers),
        "body_bytes": len(raw),
        "body": _body_value(raw, request.content_type),
    }
    _write(app, {"phase": "request", **record})
    record["phase"] = "done"
    dump = app[DUMP_KEY]
    if dump is not None and isinstance(record["body"], (dict, list)):
        name = re.sub(r"[^A-Za-z0-9]+", "_", request.path).strip("_") or "root"
        (dump / f"{seq:04d}-{name}.json").write_text(json.dumps(record["body"], indent=1, ensure_ascii=False))

    upstream = app[UPSTREAM_KEY]
    if upstream is None:
        body = {"type": "error", "error": {"type": "not_found_error", "message": f"capture proxy: no upstream for {request.path}"}}
        record.update(status=404, response_head=json.dumps(body), response_bytes=len(json.dumps(body)))
        _write(app, record)
        return web.json_response(body, status=404)

    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    t0 = time.monotonic()
    head = bytearray()
    tail = b""
    total = 0
    resp = None
    try:
        async with app[SESSION_KEY].request(
            request.method, upstream + request.path_qs, headers=headers, data=raw or None,
            allow_redirects=False, auto_decompress=False,
        ) as up:
            record["status"] = up.status
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in HOP:
                    resp.headers[k] = v
            try:
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if not total:
                        record["first_byte_s"] = round(time.monotonic() - t0, 3)
                    total += len(chunk)
                    if len(head) < HEAD_BYTES:
                        head += chunk[: HEAD_BYTES - len(head)]
                    tail = (tail + chunk)[-HEAD_BYTES:]
                    await resp.write(chunk)
            except _GONE:  # the client hung up while we were writing to it: drop the upstream too
                record["client_disconnected"] = True
                up.close()
            record.update(
                status=up.status,
                response_content_type=up.headers.get("content-type"),
                response_headers=dict(up.headers),
                response_head=head.decode("utf-8", errors="replace"),
                response_tail=tail.decode("utf-8", errors="replace") if total > HEAD_BYTES else "",
                response_bytes=total,
                elapsed_s=round(time.monotonic() - t0, 3),
            )
            _write(app, record)
            with_eof = not record.get("client_disconnected")
            if with_eof:
                await resp.write_eof()
            return resp
    except asyncio.CancelledError:  # the client hung up (handler_cancellation=True)
        record.update(client_disconnected=True, response_head=head.decode("utf-8", errors="replace"),
                      response_tail=tail.decode("utf-8", errors="replace") if total > HEAD_BYTES else "",
                      response_bytes=total, elapsed_s=round(time.monotonic() - t0, 3))
        _write(app, record)
        raise
    except aiohttp.ClientError as e:  # the upstream failed (refused, reset mid-stream)
        record.update(error=repr(e), response_head=head.decode("utf-8", errors="replace"),
                      response_bytes=total, elapsed_s=round(time.monotonic() - t0, 3))
        record.setdefault("status", 502)
        _write(app, record)
        if resp is not None:  # already streaming: all we can do is end it
            return resp
        return web.json_response({"type": "error", "error": {"type": "api_error", "message": f"capture proxy: {e!r}"}}, status=502)


async def _session_ctx(app: web.Application):
    # no total timeout: a CPU prefill of a 20k-token prompt takes minutes
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as s:
        app[SESSION_KEY] = s
        yield


def create_app(out: Path, upstream: str | None = None, dump_dir: Path | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[OUT_KEY] = out
    app[UPSTREAM_KEY] = upstream.rstrip("/") if upstream else None
    app[DUMP_KEY] = dump_dir
    app[SEQ_KEY] = itertools.count()
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
    app.cleanup_ctx.append(_session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--upstream", default=None, help="forward to this base URL (else answer 404)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL file, appended to")
    ap.add_argument("--dump-dir", type=Path, default=None, help="also write each JSON body here")
    a = ap.parse_args(argv)
    # handler_cancellation: a client that hangs up cancels the handler, which drops the
    # upstream request, so the server behind sees the disconnect exactly as without us
    web.run_app(create_app(a.out, a.upstream, a.dump_dir), host=a.host, port=a.port, print=None,
                access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
