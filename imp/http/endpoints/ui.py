"""The built-in chat UI: GET / and the static files under imp/http/ui/.

Static files only, no build step: the page talks to the same OpenAI routes any
client uses. The handler serves a file only when its name is one plain path
segment naming a regular file inside UI_DIR after symlinks are resolved, so no
request can read anything else of the checkout.
"""

from __future__ import annotations

import re
from pathlib import Path

from aiohttp import web

from imp.http.errors import ApiError

UI_DIR = Path(__file__).resolve().parent / "ui"

TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".txt": "text/plain",
    ".json": "application/json",
}
_TEXT = {".html", ".js", ".css", ".svg", ".txt", ".json"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")

# The page builds every node from model text with textContent, never markup; the
# policy is the second wall should that ever slip: no inline script, no handler
# attributes, no foreign origins, no framing.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'")


def resolve_static(root: Path, name: str) -> Path | None:
    """The file `name` names inside `root`, or None: one segment, a known type,
    no dot-segments, and still inside `root` once symlinks are followed."""
    if not _NAME.fullmatch(name) or ".." in name or Path(name).suffix not in TYPES:
        return None
    root = root.resolve()
    try:
        path = (root / name).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        return None
    if path.parent != root or not path.is_file():
        return None
    return path


def _file_response(path: Path, extra: dict[str, str] | None = None) -> web.Response:
    suffix = path.suffix
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(extra or {})}
    return web.Response(
        body=path.read_bytes(),
        content_type=TYPES[suffix],
        charset="utf-8" if suffix in _TEXT else None,
        headers=headers,
    )


_PAGE = {"Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"}


async def index(request: web.Request) -> web.Response:
    return _file_response(UI_DIR / "index.html", _PAGE)


async def static(request: web.Request) -> web.Response:
    name = request.match_info["path"]
    path = resolve_static(UI_DIR, name)
    if path is None:
        raise ApiError(404, f"no UI file '{name[:64]}'", code="not_found")
    return _file_response(path, _PAGE if path.suffix == ".html" else None)


# app.py adds routes with add_route(), which (unlike add_get) registers no HEAD:
# HEAD / is listed on its own (clients such as Claude Code probe it).
ROUTES = [
    ("GET", "/", index),
    ("HEAD", "/", index),
    ("GET", "/ui/{path}", static),
    ("HEAD", "/ui/{path}", static),
]
