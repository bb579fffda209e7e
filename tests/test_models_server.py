"""Models on demand through a real server (CPU executor): SmolLM2 and two synthetic models of the test
fixtures (qwen3 and llama shapes) in --models-dir, a --models-memory that holds two of the three. Requests
name them interleaved through the official SDKs, some while others stream: each model answers as it did
before its swaps (greedy), no request is lost or cut, the metrics are each model's own, and every
model's event-log stream replays. The fleet's decisions are test_residency's and test_fleet's."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.serverproc import ServerProcess, call, free_port, stream_completion

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[0, 2], ids=["one-process", "api-servers-2"])
def fleet_server(request, smollm2_path, tmp_path_factory):
    """One process, and the process layout (the fleet in the engine process, two API servers routing by
    model: imp.engine.remote_fleet)."""
    from tests.fixtures.synth import write_synthetic_gguf

    d = tmp_path_factory.mktemp("fleet")
    models = d / "models"
    models.mkdir()
    shutil.copy(smollm2_path, models / "smol.gguf")
    # ~60 MB each: the budget below holds SmolLM2 (~190 MB estimated) and one of them, never all three
    for name, arch in (("qwen3-synth", "qwen3"), ("llama-synth", "llama")):
        write_synthetic_gguf(str(models / f"{name}.gguf"), arch=arch, n_layers=6, d_model=768, n_heads=12,
                             n_kv_heads=4, d_ff=2048, vocab=512, head_dim=64, seed=len(name))
    (models / "broken.gguf").write_bytes(b"GGUF")  # listed; naming it answers why it cannot load
    (models / "models.toml").write_text('[smol]\naliases = ["gpt-4o-mini"]\n')
    log = d / "events.log"
    agent = free_port()
    srv = ServerProcess(str(models / "smol.gguf"), "--models-dir", str(models), "--models-file",
                        str(models / "models.toml"), "--kv-cache-tokens", "4096", "--models-memory", "0.30",
                        "--event-log", str(log), "--api-servers", str(request.param), "--agent-port", str(agent),
                        log_path=d / "server.out")
    srv.dir, srv.agent_port = d, agent
    with srv:
        yield srv


def _loaded(url) -> dict:
    return {m["id"]: m for m in json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"]}


def test_models_by_name_swap_within_the_budget_and_answer_alike(fleet_server):
    import anthropic
    import openai

    url = fleet_server.url
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
    listing = _loaded(url)
    assert {"smol", "qwen3-synth", "llama-synth", "broken"} <= set(listing)
    assert listing["smol"]["loaded"] and not listing["qwen3-synth"]["loaded"]
    assert listing["smol"]["aliases"] == ["gpt-4o-mini"] and listing["smol"]["context_length"] == 8192

    def chat(model):
        r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=8, temperature=0)
        assert r.model in ("smol", "qwen3-synth", "llama-synth") and r.usage.completion_tokens == 8
        return r.choices[0].message.content

    def message(model):
        r = an.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": "Name a colour."}])
        return r.content[0].text

    first = {m: (chat(m), message(m)) for m in ("qwen3-synth", "llama-synth", "gpt-4o-mini")}
    budget = 0.30 * 2**30
    for _ in range(2):  # interleaved: every request but the first of a round swaps
        for m in ("qwen3-synth", "llama-synth", "gpt-4o-mini"):
            assert (chat(m), message(m)) == first[m]
            listing = _loaded(url)
            assert sum(x["resident_bytes"] for x in listing.values()) <= budget
            assert sum(x["loaded"] for x in listing.values()) <= 2
    with pytest.raises(openai.NotFoundError) as e:
        chat("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as e2:
        message("no-such-model")
    assert e2.value.body["error"]["type"] == "not_found_error"
    # one Responses store for every model: a response made on one model continues on another
    r1 = oa.responses.create(model="qwen3-synth", input="Name a colour.", max_output_tokens=8, temperature=0)
    r2 = oa.responses.create(model="smol", input="And another?", previous_response_id=r1.id, max_output_tokens=8,
                             temperature=0)
    assert r1.model == "qwen3-synth" and r2.model == "smol" and oa.responses.retrieve(r1.id).id == r1.id
    st, body = call(url, "/v1/completions", {"model": "broken", "prompt": "x", "max_tokens": 2})
    assert st == 500 and body["error"]["code"] == "model_load_failed", body
    assert call(url, "/v1/completions", {"model": "smol", "prompt": "x", "max_tokens": 2})[0] == 200  # serves on


def test_requests_during_swaps_all_finish(fleet_server):
    url = fleet_server.url
    names = ["qwen3-synth", "llama-synth", "smol"] * 4

    def stream(i: int) -> tuple[str, int, str]:
        _, tokens, finish = stream_completion(url, {"model": names[i], "prompt": f"Count {i}:", "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True})
        return names[i], tokens, finish

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(stream, range(len(names))))
    assert all(t == 24 and f == "length" for _, t, f in got), got
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    for m in ("smol", "qwen3-synth", "llama-synth"):
        assert f'imp_model_swaps_total{{direction="in",model="{m}"}}' in metrics
    assert metrics.count("# TYPE imp_requests_total counter") == 1  # one family, a sample per model
    health = json.load(urllib.request.urlopen(url + "/health", timeout=30))
    assert health["swapping"] is None and health["kv_blocks_used"] == 0
    # every resident model's own figures, not the boot model's alone; nothing left held in any
    assert set(health["models"]) == set(health["models_loaded"]) and len(health["models"]) >= 1, health
    assert all(m["kv_blocks_used"] == 0 and m["kv_blocks_total"] > 0 and m["fault"] is None
               for m in health["models"].values()), health
    import socket

    with socket.create_connection(("127.0.0.1", fleet_server.agent_port), timeout=10) as sock:
        assert sock.makefile().readline() == "up ready 100%\n"  # the agent reads the fleet; idle now


def test_suspend_releases_every_model_until_resume(fleet_server):
    """POST /admin/suspend with models on demand gives back every model's memory, not the boot model's alone;
    nothing is served or loaded until /admin/resume, which brings the boot model back."""
    url = fleet_server.url
    ask = {"prompt": "x", "max_tokens": 2}
    assert call(url, "/v1/completions", {**ask, "model": "smol"})[0] == 200
    assert call(url, "/v1/completions", {**ask, "model": "qwen3-synth"})[0] == 200  # two resident now
    st, body = call(url, "/admin/suspend?drain_s=10", {}, "POST")
    assert st == 200 and body["suspended"] and body["kv_released"], body
    assert body["models_released"] == ["qwen3-synth"], body
    assert not any(m["loaded"] for m in _loaded(url).values())
    for model in ("smol", "llama-synth"):
        st, err = call(url, "/v1/completions", {**ask, "model": model})
        assert st == 503 and err["error"]["code"] == "suspended", err
    st, err = call(url, "/admin/models/load", {"model": "llama-synth"})
    assert st == 409 and err["error"]["code"] == "suspended", err
    assert not any(m["loaded"] for m in _loaded(url).values())  # nothing loaded meanwhile
    st, body = call(url, "/admin/resume", {}, "POST")
    assert st == 200 and body["reloaded"], body
    assert [n for n, m in _loaded(url).items() if m["loaded"]] == ["smol"]
    assert call(url, "/v1/completions", {**ask, "model": "llama-synth"})[0] == 200  # loads on demand again


def test_admin_load_unload_and_every_models_log_replays(fleet_server):
    url = fleet_server.url
    st, body = call(url, "/admin/models/load", {"model": "llama-synth"})
    assert st == 200 and body["loaded"] and body["resident_bytes"] > 0, body
    st, body = call(url, "/admin/models/unload", {"model": "llama-synth"})
    assert st == 200 and body["unloaded"] and not body["loaded"], body
    st, body = call(url, "/admin/models/unload", {"model": "llama-synth"})
    assert st == 409 and body["error"]["code"] == "model_not_loaded"
    ask = {"model": "llama-synth", "messages": [{"role": "user", "content": "hi"}]}
    for path, b in (("/v1/estimate", ask), ("/v1/chat/completions", {**ask, "dry_run": True})):
        st, est = call(url, path, b)  # an estimate never loads a model (capacity reference)
        assert st == 200 and est["resident"] is False and est["model"] == "llama-synth", est
    row = _loaded(url)["llama-synth"]
    assert not row["loaded"] and row["max_context_at_width_1"] is None and row["context_length"] == 2048
    assert call(url, "/admin/models/load", {"model": "smol"})[0] == 200
    st, est = call(url, "/v1/estimate", {**ask, "model": "smol"})
    assert st == 200 and est["resident"] is True and est["prompt_tokens"] > 0, est
    st, body = call(url, "/admin/models/load", {"model": "nope"})
    assert st == 404 and body["error"]["code"] == "model_not_found"
    st, body = call(url, "/admin/models/load", {})
    assert st == 400 and body["error"]["param"] == "model"
    ready = json.load(urllib.request.urlopen(url + "/ready", timeout=30))
    assert ready["ready"] is True
    t0 = time.monotonic()
    assert fleet_server.stop() == 0  # SIGTERM: every model's log flushed and closed
    assert time.monotonic() - t0 < 8  # the process layout too (its API servers reaped: was 11.5 s)
    logs = sorted(fleet_server.dir.glob("events*.log"))
    assert {p.name for p in logs} >= {"events.log", "events.llama-synth.log"}  # and each model's the others loaded
    for p in logs:
        r = subprocess.run([sys.executable, "-m", "imp", "replay", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, (p, r.stdout + r.stderr)
