"""API keys and the rate limit (imp.http.access) against the real app and a fake engine:
every route but the probes and the UI page answers 401 without a key, in its dialect's
shape; keys from a file; both header spellings; the per-key bucket and its Retry-After."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from imp.config import ServerConfig
from imp.http.access import RateLimiter, load_api_keys
from imp.http.app import create_app
from imp.http.routes import ROUTES
from tests.fake_engine import FakeEngine
from tests.serverproc import ROOT

MSGS = [{"role": "user", "content": "Say hello."}]
OPEN = {("GET", "/health"), ("GET", "/ready")}


@pytest.fixture
async def make_client():
    clients = []

    async def make(config: ServerConfig, api_keys=None) -> TestClient:
        eng = FakeEngine()
        c = TestClient(TestServer(create_app(eng, eng.tm, config, api_keys=api_keys)))
        await c.start_server()
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x1", path)


async def test_every_route_but_the_probes_needs_a_key(make_client):
    c = await make_client(ServerConfig(), api_keys=("k-one", "k-two"))
    guarded = 0
    for method, path, _ in ROUTES:
        if (method, path) in OPEN or (method in ("GET", "HEAD") and (path == "/" or path.startswith("/ui"))):
            continue
        r = await c.request(method, concrete(path), json={})
        body = await r.json()
        assert r.status == 401, (method, path, r.status, body)
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
        else:
            assert body["error"]["code"] == "invalid_api_key", body
        r = await c.request(method, concrete(path), json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status == 401, (method, path)
        guarded += 1
    assert guarded >= 20
    for path in ("/health", "/ready", "/"):
        assert (await c.get(path)).status == 200, path
    # both keys, both spellings
    ok = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS},
                      headers={"Authorization": "Bearer k-two"})
    assert ok.status == 200
    ok = await c.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSGS},
                      headers={"x-api-key": "k-one"})
    assert ok.status == 200
    assert (await c.get("/metrics", headers={"x-api-key": "k-one"})).status == 200


async def test_the_rate_limit_is_per_key_across_dialects_with_retry_after(make_client):
    c = await make_client(ServerConfig(rate_limit=3), api_keys=("a", "b"))
    a, b = {"Authorization": "Bearer a"}, {"x-api-key": "b"}
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": MSGS}),
                       ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": MSGS}),
                       ("/v1/models", None)):
        r = await (c.post(path, json=body, headers=a) if body else c.get(path, headers=a))
        assert r.status == 200, path
    r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSGS}, headers=a)
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    body = await r.json()
    assert body["error"]["type"] == "rate_limit_error", body
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS}, headers=a)
    assert r.status == 429 and (await r.json())["error"]["code"] == "rate_limit_exceeded"
    assert (await c.get("/health")).status == 200  # probes are never limited
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS}, headers=b)
    assert r.status == 200  # another key, its own bucket


async def test_without_keys_the_limit_is_per_address(make_client):
    c = await make_client(ServerConfig(rate_limit=1))
    assert (await c.get("/v1/models")).status == 200
    assert (await c.get("/v1/models")).status == 429


def test_the_bucket_refills_at_the_rate():
    lim = RateLimiter(60)  # one a second, a burst of 60
    assert all(lim.take("k", 100.0) == 0 for _ in range(60))
    assert lim.take("k", 100.0) == pytest.approx(1.0)
    assert lim.take("k", 100.5) == pytest.approx(0.5)
    assert lim.take("k", 101.5) == 0  # a second later one more is allowed
    assert lim.take("other", 101.5) == 0


def test_keys_from_a_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\n  beta  # the CI runner\nalpha\n")
    assert load_api_keys("cli", str(f)) == ("cli", "alpha", "beta")
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="No such file"):
        load_api_keys(None, str(tmp_path / "missing"))


def test_a_missing_key_file_is_a_start_up_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "imp", "--port", "1", "--api-key-file", str(tmp_path / "nope")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--api-key-file" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "messages": MSGS}),
    ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": MSGS}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
])
async def test_request_supplied_chat_templates_are_refused(make_client, path, body):
    c = await make_client(ServerConfig())
    for field in ("chat_template", "template"):
        r = await c.post(path, json={**body, field: "{{ messages }}"})
        err = await r.json()
        assert r.status == 400 and field in err["error"]["message"], err
    assert (await c.post(path, json=body)).status == 200
