"""`python -m imp` — serve (default), `replay LOG`, `pull NAME`."""

from __future__ import annotations

import argparse
import os
import sys

# A CPU named for Numba's codegen (NUMBA_CPU_NAME=haswell: the AVX2 tier on any x86 box) means that
# CPU's own features; Numba alone pairs the name with this host's features (AVX-512 where the host
# has it), which is not the tier the name says. Set before anything imports Numba.
if os.environ.get("NUMBA_CPU_NAME", "host") != "host" and "NUMBA_CPU_FEATURES" not in os.environ:
    os.environ["NUMBA_CPU_FEATURES"] = ""


def _server_kernel_cache() -> None:
    """The server's compiled kernels go to $IMP_CACHE/numba (default ~/.cache/imp/numba), not the
    checkout's __pycache__ folders. Why: Numba's cache index is read, changed and written back
    by whoever compiles; two processes compiling different signatures of one kernel at the same
    moment can leave an entry naming the other's code, and the next boot that loads it crashes
    (seen here: a test run compiling beside a booting server left a cache every later boot of that
    tier segfaulted on). Server boots take a lock on their cache (imp.precompile.compile_lock);
    a test run or a benchmark in the checkout does not, so the server keeps its own. Not where
    NUMBA_CACHE_DIR is set, or the folder cannot be written (Numba would refuse to cache)."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    from imp.fetch import cache_dir

    path = cache_dir() / "numba"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if os.access(path, os.W_OK):
        os.environ["NUMBA_CACHE_DIR"] = str(path)


_server_kernel_cache()

from imp.config import add_serve_args, config_from_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replay":
        from imp.core.replay import main as replay_main
        from imp.core.replay import parser as replay_parser

        model = replay_parser().parse_args(argv[1:]).model
        fp = None
        if model is not None:  # the model's fingerprint: what its KV allocator would be built with
            from imp.fetch import FetchError, resolve_model
            from imp.formats.gguf_loader import open_gguf
            from imp.formats.hf_dir import open_hf_dir

            try:
                path = resolve_model(model)
                fp = (open_hf_dir(path) if path.is_dir() else open_gguf(path)).fingerprint
            except (FetchError, OSError, ValueError) as exc:
                print(f"replay: cannot read the model {model}: {exc}", file=sys.stderr)
                return 2
        return replay_main(argv[1:], expect_fingerprint=fp)
    if argv and argv[0] in ("_engine", "_api"):  # children of the supervisor (imp.procs)
        from imp import procs

        return (procs.engine_main if argv[0] == "_engine" else procs.api_main)(argv[1:])
    if argv and argv[0] == "_precompile":  # a cold boot's compile child (imp.precompile)
        from imp.server import precompile_main

        return precompile_main(argv[1:])
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
    if cfg.embedding_model:  # fetched and checked once, here: every HTTP process loads it
        from imp.fetch import FetchError, resolve_model
        from imp.model.bert import check

        try:
            check(resolve_model(cfg.embedding_model))
        except (FetchError, OSError, ValueError) as exc:
            p.error(f"--embedding-model: {exc}")
    import os

    from imp.config import api_servers

    if api_servers(cfg, os.cpu_count() or 1) > 0:  # an engine process and API-server processes
        from imp.procs import supervise

        return supervise(cfg)
    from imp.server import serve

    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
