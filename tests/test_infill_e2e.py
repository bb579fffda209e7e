"""POST /infill and /v1/completions' suffix end to end, on a model that has fill-in-the-middle
tokens: a synthetic random-weight GGUF recording fim_pre/suf/mid ids (the packaged models
have none, so with them both routes are 400 fim_not_supported). The text is noise; the
prompt layout, the llama.cpp response shape, streaming and the two routes' agreement are
what is checked."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.slow

PRE, SUF, MID = 300, 301, 302  # "<unused40>".."<unused42>" in the synthetic vocabulary


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    from tests.fixtures.synth import write_synthetic_gguf

    return write_synthetic_gguf(str(tmp_path_factory.mktemp("fim") / "fim.gguf"), n_layers=2, d_model=64,
                                n_heads=4, n_kv_heads=2, d_ff=128, vocab=512, fim_ids=(PRE, SUF, MID))


def _sse(url, path, body) -> list[dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = r.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_infill_layout_shape_stream_and_completions_suffix(fim_model, tmp_path):
    from tests.serverproc import ServerProcess, call

    with ServerProcess(fim_model, "--kv-cache-tokens", "1024", log_path=tmp_path / "f.out") as srv:
        st, props = call(srv.url, "/props")
        assert st == 200 and props["fim"] is True
        ids = {t: call(srv.url, "/tokenize", {"content": t})[1]["tokens"] for t in ("def f(", "x", "):\n")}
        body = {"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x", "n_predict": 8,
                "temperature": 0, "return_tokens": True}
        st, out = call(srv.url, "/infill", body)
        assert st == 200, out
        # llama.cpp's layout: <PRE> prefix prompt <SUF> suffix <MID>, no BOS for this vocabulary
        assert out["prompt"] == "<unused40>def f(x<unused41>):\n<unused42>"
        assert out["tokens_evaluated"] == 3 + len(ids["def f("]) + len(ids["x"]) + len(ids["):\n"])
        assert out["stop"] is True and 1 <= out["tokens_predicted"] <= 8 and len(out["tokens"]) == out["tokens_predicted"]
        assert out["stop_type"] in ("limit", "eos") and isinstance(out["content"], str)
        assert out["generation_settings"]["n_predict"] == 8

        events = _sse(srv.url, "/infill", {**body, "stream": True})
        assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
        assert "".join(e["content"] for e in events) == out["content"]  # greedy: the same middle

        # /v1/completions with a suffix is the same request in OpenAI's dialect
        st, c = call(srv.url, "/v1/completions", {"model": "m", "prompt": "def f(x", "suffix": "):\n",
                                                  "max_tokens": 8, "temperature": 0})
        assert st == 200 and c["choices"][0]["text"] == out["content"], c
        assert c["usage"]["prompt_tokens"] == out["tokens_evaluated"]

        # input_extra without repo/file-separator tokens: text chunks behind a snippet marker, first
        st, x = call(srv.url, "/infill", {**body, "input_extra": [{"filename": "a.py", "text": "y = 1"}]})
        assert st == 200 and x["prompt"].startswith("\n\n--- snippet ---\n\ny = 1<unused40>def f(x"), x["prompt"]
        st, e = call(srv.url, "/infill", {**body, "input_extra": [{"filename": "a.py", "text": 3}]})
        assert st == 400 and "input_extra" in (e["error"].get("param") or e["error"]["message"]), e
        st, h = call(srv.url, "/health")
        assert h["kv_blocks_used"] == 0 and h["kv_blocks_reserved"] == 0
