"""Custom tools on the real model (SmolLM2, CPU) through the official openai SDK, temperature 0.8:
in every tool_choice mode, stream and not, every completed custom_tool_call's input parses
under its grammar with the `lark` package (a regex with re.fullmatch); a forced choice always
calls; the streamed input deltas spell the final input. bench/custom_tools.py prints the table."""

from __future__ import annotations

import asyncio

import pytest

from bench import custom_tools as ct

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    from tests.serverproc import ServerProcess

    d = tmp_path_factory.mktemp("custom")
    with ServerProcess(smollm2_path, "--responses-store", "off", log_path=d / "server.out") as srv:
        yield srv


@pytest.mark.parametrize("grammar,n", [("greet", 20), ("zip", 20), ("apply_patch", 6)])  # apply_patch: ~6 s a sample
def test_every_custom_call_parses_under_its_grammar(server, grammar, n):
    rows = asyncio.run(ct.run(server.url, n, 8, 256, [grammar]))
    print("\n" + ct.table(rows))
    assert len(rows) == 6  # auto / required / named, stream and not
    for r in rows:
        assert r["parsed"] == r["calls"], r  # every completed call's input parses
        if r["mode"] != "auto":  # a forced choice calls every time (completed, or cut by max_output_tokens)
            assert r["calls"] + r["cut"] >= r["samples"], r
    assert sum(r["calls"] for r in rows) >= n  # and the model does call it
