"""How far one request field travels before the engine sees it: rooms, calls, returns.

Sends one chat-completions request with `max_tokens` through the real app over a fake
engine (tests/fake_engine.py: no model) with a tracer on, from the moment the route's
handler is entered to the moment the engine port's `submit` is called, and counts what a
reader following the code meets: the imp modules entered (rooms), the calls into the
body-field reader module, the calls that cross from one module to another, and the returns
that go back to a module already left. Prints one table; `--tree DIR` runs it on another
checkout (an older commit in a worktree) for a before/after.

    python bench/field_walk.py [--tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    sys.path.insert(0, tree)
    from aiohttp.test_utils import TestClient, TestServer

    from imp.config import ServerConfig
    from imp.http.app import create_app
    from tests.fake_engine import FakeEngine

    pkg = os.path.join(tree, "imp") + os.sep
    walk: list[tuple[str, str, str]] = []  # (event, module, function)
    state = {"on": False}

    def mod(frame) -> str | None:
        f = frame.f_code.co_filename
        return f[len(pkg):-3].replace(os.sep, ".") if f.startswith(pkg) and f.endswith(".py") else None

    def tracer(frame, event, arg):
        if event not in ("call", "return"):
            return tracer
        m = mod(frame)
        name = frame.f_code.co_name
        if event == "call" and not state["on"] and m is not None and m.startswith("http.") and \
                name in ("chat_completions", "handle") and frame.f_back is not None and mod(frame.f_back) != m:
            state["on"] = True
        if state["on"] and m is not None:
            walk.append((event, m, name))
        return tracer

    class Probe(FakeEngine):
        def submit(self, sub):
            state["on"] = False
            return super().submit(sub)

    async def run() -> None:
        eng = Probe()
        app = create_app(eng, eng.tm, ServerConfig())
        async with TestClient(TestServer(app)) as c:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
            await (await c.post("/v1/chat/completions", json=body)).read()  # warm: imports, caches
            walk.clear()
            sys.settrace(tracer)
            r = await c.post("/v1/chat/completions", json=body)
            sys.settrace(None)
            assert r.status == 200, await r.text()

    asyncio.run(run())
    rooms: list[str] = []
    stack: list[str] = []
    calls_x = returns_back = field_calls = 0
    left: set[str] = set()
    field_mods = ("http.body", "http.pipeline.fields")
    for ev, m, _ in walk:
        if ev == "call":
            caller = stack[-1] if stack else None
            if caller is not None and caller != m:
                calls_x += 1
                left.add(caller)
                if m in field_mods:
                    field_calls += 1
            if m not in rooms:
                rooms.append(m)
            stack.append(m)
        elif stack:
            stack.pop()
            back = stack[-1] if stack else None
            if back is not None and back != m and back in left:
                returns_back += 1
    print(f"tree: {tree}")
    print("| rooms (imp modules entered) | calls across modules | calls into the body-field reader | "
          "returns to a module already left |")
    print("|---|---|---|---|")
    print(f"| {len(rooms)} | {calls_x} | {field_calls} | {returns_back} |")
    print("rooms in order:", " -> ".join(rooms))


if __name__ == "__main__":
    main()
