"""`python -m imp` — serve (default), `replay LOG`, `pull NAME`."""

from __future__ import annotations

import argparse
import sys

from imp.config import add_serve_args, config_from_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replay":
        from imp.core.replay import main as replay_main

        return replay_main(argv[1:])
    if argv and argv[0] == "pull":
        p = argparse.ArgumentParser(prog="python -m imp pull")
        p.add_argument("name")
        ns = p.parse_args(argv[1:])
        from imp.fetch import resolve_model

        print(resolve_model(ns.name))
        return 0
    if argv and argv[0] == "serve":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m imp", description="imp LLM inference server")
    add_serve_args(p)
    ns = p.parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ValueError as exc:
        p.error(str(exc))
    from imp.server import serve

    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
