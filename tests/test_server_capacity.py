"""Capacity and live metrics (/v1/capacity/plan, /v1/estimate, /v1/metrics),
readiness (/health?ready=1, /ready) and admin suspend/resume.

Fast units for the pure helpers; the e2e tests (marked slow) run against the
one shared real server (tests/conftest.py `imp_server`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from imp.actors.metrics import Rates
from imp.http.endpoints.capacity import band_of, plan, prometheus, snapshot
from imp.http.pipeline.estimate import estimate
from imp.messages import (
    Delta,
    FinishReason,
    KvFigures,
    QueueFigures,
    SamplingParams,
    StepStats,
    TokenOut,
)

import pytest

MSGS = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def kv(total=512, used=0, reserved=0, block_size=16, cached=0):
    return KvFigures(total, total - used, used, reserved, cached, block_size)


# --------------------------------------------------------------------------- pure helpers


def test_band_thresholds_use_the_larger_of_used_and_reserved():
    assert band_of(kv(100, used=69)) == "green"
    assert band_of(kv(100, used=10, reserved=70)) == "yellow"
    assert band_of(kv(100, used=85)) == "orange"
    assert band_of(kv(100, reserved=95)) == "red"
    assert band_of(kv(100, used=60, reserved=60)) == "green"  # not summed: reserved counts used blocks


def test_plan_memory_and_timing_answers():
    q = QueueFigures(0, 1, 0)
    p = plan(4, 1024, kv=kv(512), queue=q, max_context=8192, decode_batch=8, model="m")
    assert p == {"width": 4, "depth": 1024, "ok": True, "max_context_at_width": 2048, "max_width_at_depth": 8,
                 "model": "m", "band": "green", "decode_batch": 8, "in_flight": 1, "waiting": 0, "slots": 7,
                 "admit_now": True, "reason": "ok"}
    p = plan(4, 4096, kv=kv(512), queue=q, max_context=8192, decode_batch=8, model="m")
    assert (p["ok"], p["admit_now"], p["reason"]) == (False, False, "depth 4096 exceeds max context 2048 at width 4")
    assert plan(1, 9000, kv=kv(1024), queue=q, max_context=8192, decode_batch=8, model="m")["max_width_at_depth"] == 0
    p = plan(8, 16, kv=kv(512), queue=q, max_context=8192, decode_batch=8, model="m")
    assert p["reason"] == "7 free slot(s) of 8, need 8" and p["ok"] and not p["admit_now"]
    p = plan(1, 16, kv=kv(512), queue=QueueFigures(2, 8, 100), max_context=8192, decode_batch=8, model="m")
    assert p["reason"] == "2 waiting for a slot"
    p = plan(1, 16, kv=kv(100, used=90), queue=q, max_context=8192, decode_batch=8, model="m")
    assert p["reason"] == "governor orange"
    # yellow: only one slot counts as free
    assert plan(2, 16, kv=kv(100, used=75), queue=q, max_context=8192, decode_batch=8,
                model="m")["reason"] == "1 free slot(s) of 8, need 2"
    assert plan(1, 16, kv=kv(100, used=75), queue=q, max_context=8192, decode_batch=8, model="m")["admit_now"]


def test_estimate_fits_and_ttft():
    e = estimate(100, max_tokens=None, n=1, kv=kv(10, used=2), bytes_per_token=1000, max_context=2048,
                 prefill_tok_s=200.0, queued_prompt_tokens=300, model="m")
    assert (e["need_blocks"], e["need_bytes"], e["fits_now"], e["fits_drained"]) == (7, 7 * 16 * 1000, True, True)
    assert (e["context_ok"], e["context_limit"], e["est_ttft_s"], e["resident"]) == (True, 2048, 2.0, True)
    assert (e["warm_tokens"], e["cache_tier"]) == (0, "miss")
    e = estimate(100, max_tokens=60, n=1, kv=kv(10, used=2, reserved=5), bytes_per_token=1000, max_context=2048,
                 prefill_tok_s=None, queued_prompt_tokens=0, model="m")
    assert (e["need_blocks"], e["fits_now"], e["fits_drained"], e["est_ttft_s"]) == (10, False, True, None)
    e = estimate(3000, max_tokens=None, n=1, kv=kv(10), bytes_per_token=None, max_context=2048,
                 prefill_tok_s=1.0, queued_prompt_tokens=0, model="m")
    assert (e["context_ok"], e["fits_drained"], e["need_bytes"]) == (False, False, None)


def test_rates_from_step_stats():
    r = Rates(stale_s=2.0)
    assert r.snapshot(0.0)["decode_tok_s"] == 0.0 and r.prefill_tok_s_recent is None
    r.observe(StepStats(1, 1, 100, 0, 500_000_000), 1.0)  # 100 prefill tokens in 0.5 s
    r.observe(StepStats(2, 2, 2, 2, 100_000_000), 1.1)  # 2 decodes in 0.1 s
    r.observe(StepStats(3, 4, 4, 4, 100_000_000), 1.2)
    s = r.snapshot(1.3)
    assert (s["prefill_tok_s_recent"], s["decode_tok_s"], s["decode_streams"]) == (200.0, 40.0, 4)
    assert s["decode_tok_s_recent"] == s["decode_tok_s_lifetime"] == 30.0
    assert r.snapshot(9.0)["decode_tok_s"] == 0.0  # stale: nothing decoding now
    r.observe(StepStats(4, 1, 5, 1, 0), 9.0)  # zero-length step: ignored
    assert r.prefill_tokens == 100


def _card_and_snapshot(kv_bytes_per_token=None):
    from imp.engine import port

    card = port.ModelCard(name="m", path="", fingerprint="f" * 64, context_length=2048, vocab_size=1000,
                          block_size=16, kv_blocks=512, kv_bytes_per_token=kv_bytes_per_token, replicas=1,
                          max_batch_size=8, max_queued_tokens=0, retry_after_s=1.0, device="cpu", created=0)
    snap = port.Snapshot(kv=kv(512, used=10), replica_kv=(kv(512, used=10),), queue=QueueFigures(1, 2, 40),
                         rates=port.Rates(), suspended=False, draining=False, fault=None, rejections=3,
                         last_reject_reason="suspended", in_flight=3, uptime_s=1.0,
                         live=(port.LiveRow(id="a", state="queued", prompt_tokens=3, generated=0, max_tokens=9,
                                            n=1, elapsed_s=0.5),))
    return card, snap


def test_snapshot_nulls_a_failed_section_and_prometheus_parses():
    from prometheus_client.parser import text_string_to_metric_families

    s = snapshot(*_card_and_snapshot(kv_bytes_per_token=None))["server"]  # no KV size: the memory probe fails
    assert set(s["memory"]) >= {"rss_bytes", "kv_pool_bytes"} and set(s["memory"].values()) == {None}
    assert s["concurrency"] == {"decode_batch": 8, "queue_cap": None, "queued_tokens_cap": None,
                                "in_flight": 2, "waiting": 1}
    assert s["governor"]["band"] == "green" and s["queue"]["rejections"] == 3
    assert s["capacity"]["max_ctx_at_width"] == {"1": 2048, "2": 2048, "4": 2048, "8": 1024}
    text = prometheus({"server": s})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["imp_concurrency_in_flight"].samples[0].value == 2
    assert "imp_memory_rss_bytes" not in fams  # null fields are left out
    bands = {x.labels["band"]: x.value for x in fams["imp_governor_band"].samples}
    assert bands == {"green": 1, "yellow": 0, "orange": 0, "red": 0}
    assert {x.labels["width"]: x.value for x in fams["imp_capacity_max_ctx"].samples}["8"] == 1024
    assert fams["imp_requests_count"].samples[0].value == 1


def test_ingress_live_rows():
    from imp.actors.base import Bus
    from imp.log.eventlog import EventLog
    from imp.actors.ingress import IngressActor

    async def go():
        ing = IngressActor(Bus(EventLog(None)))
        for rid in ("a", "b", "c"):
            ing.submit(rid, [1, 2, 3], SamplingParams(max_tokens=9))
        await ing.on_message("detok", Delta(TokenOut("a", 0, (5, 6)), "x"))
        ing.suspend()
        assert ing.suspended
        rows = ing.live_rows(ing.handles["a"].arrival + 1.0, waiting=1)
        assert [(r["id"], r["state"]) for r in rows] == [("c", "queued"), ("b", "prefill"), ("a", "decode")]
        a = rows[-1]
        assert (a["prompt_tokens"], a["generated"], a["max_tokens"]) == (3, 2, 9)
        assert a["ttft_s"] is not None and a["elapsed_s"] == 1.0
        await ing.on_message("detok", Delta(TokenOut("a", 0, (), FinishReason.STOP), "", FinishReason.STOP))
        ing.release("a")
        assert [r["id"] for r in ing.live_rows(0.0, 0)] == ["b", "c"]

    asyncio.run(go())


# --------------------------------------------------------------------------- e2e


def raw(server, method, path, body=None, timeout=60):
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def jraw(server, method, path, body=None):
    status, headers, data = raw(server, method, path, body)
    return status, headers, json.loads(data)


def chat(server, max_tokens=4, **kw):
    return jraw(server, "POST", "/v1/chat/completions",
                {"model": "x", "messages": MSGS, "max_tokens": max_tokens, "temperature": 0, **kw})


@pytest.mark.slow
def test_capacity_plan_shape_and_bad_params(imp_server):
    st, _, p = jraw(imp_server, "GET", "/v1/capacity/plan?width=2&depth=1024")
    assert st == 200 and p["ok"] is True and p["admit_now"] is True and p["reason"] == "ok"
    assert p["max_context_at_width"] == 4096 and p["max_width_at_depth"] == 8  # 8192-token pool, ctx 8192
    assert p["band"] == "green" and p["decode_batch"] == p["slots"] + p["in_flight"]
    st, _, p = jraw(imp_server, "GET", "/v1/capacity/plan?width=4&depth=4096")
    assert st == 200 and p["ok"] is False and p["reason"] == "depth 4096 exceeds max context 2048 at width 4"
    for q in ("", "?width=2", "?depth=5", "?width=0&depth=5", "?width=x&depth=5", "?width=2&depth=-1",
              "?width=1.5&depth=5"):
        st, _, e = jraw(imp_server, "GET", "/v1/capacity/plan" + q)
        assert st == 400 and e["error"]["type"] == "invalid_request_error" and e["error"]["param"], q


@pytest.mark.slow
def test_estimate_and_dry_run(imp_server):
    assert chat(imp_server)[0] == 200  # a prefill has been measured: est_ttft_s is a number
    body = {"model": "x", "messages": MSGS, "max_tokens": 100}
    st, _, e = jraw(imp_server, "POST", "/v1/estimate", body)
    assert st == 200 and e["resident"] is True
    # warm_tokens / cache_tier: the prefix cache asked. Every full block of the prompt an alloc may take (all but
    # the one holding its last token) is there, since the chat above sent these messages
    assert e["cache_tier"] == "exact" and e["warm_tokens"] == (e["prompt_tokens"] - 1) // 16 * 16 > 0
    cold = dict(body, messages=[{"role": "user", "content": f"{time.time_ns()} " * 40}])
    st, _, e2 = jraw(imp_server, "POST", "/v1/estimate", cold)
    # a new conversation: only the blocks of the template's own head (SmolLM2's default system prompt) are warm
    assert st == 200 and e2["cache_tier"] in ("block", "miss") and e2["warm_tokens"] <= 48 < e2["prompt_tokens"]
    assert e["prompt_tokens"] > 5 and e["context_ok"] and e["fits_now"] and e["fits_drained"]
    assert e["context_limit"] == 8192 and e["est_ttft_s"] > 0
    # SmolLM2: 30 layers x 3 KV heads x 64 x 2 (K, V) x fp32 per token
    assert e["need_bytes"] == e["need_blocks"] * 16 * 30 * 3 * 64 * 2 * 2  # fp16 K and V (the fused CPU model)
    st, _, d = jraw(imp_server, "POST", "/v1/chat/completions", dict(body, dry_run=True))
    assert st == 200 and "choices" not in d
    assert {k: d[k] for k in ("prompt_tokens", "need_bytes", "context_limit")} == \
        {k: e[k] for k in ("prompt_tokens", "need_bytes", "context_limit")}
    long = {"model": "x", "messages": [{"role": "user", "content": "hello " * 9000}]}
    st, _, e = jraw(imp_server, "POST", "/v1/estimate", long)
    assert st == 200 and e["context_ok"] is False and e["fits_drained"] is False
    for bad in ({"model": "x"}, {"model": "x", "messages": MSGS, "max_tokens": 0},
                {"model": "x", "messages": MSGS, "temperature": 9}, {"model": "x", "messages": MSGS, "dry_run": 1}):
        st, _, err = jraw(imp_server, "POST", "/v1/estimate", bad)
        assert st == 400 and "error" in err, bad


@pytest.mark.slow
def test_metrics_snapshot_json_and_prometheus(imp_server):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    t = threading.Thread(target=lambda: out.update(r=chat(imp_server, max_tokens=40, ignore_eos=True)))
    t.start()
    rows = []
    deadline = time.monotonic() + 20
    while not rows and time.monotonic() < deadline:  # catch the request live
        rows = jraw(imp_server, "GET", "/v1/metrics")[2]["server"]["requests"]
        time.sleep(0.02)
    t.join()
    assert out["r"][0] == 200 and rows, "never saw the request live"
    row = rows[0]
    assert row["state"] in ("queued", "prefill", "decode") and row["max_tokens"] == 40
    assert row["prompt_tokens"] > 5 and row["elapsed_s"] >= 0
    # the server speculates by default: the row holds its drafter's rounds and accept rate
    assert set(row["speculative"]) == {"rounds", "drafted", "accepted", "accept_rate"}, row
    st, _, snap = jraw(imp_server, "GET", "/v1/metrics")
    s = snap["server"]
    assert st == 200 and all(r["id"] != row["id"] for r in s["requests"])  # released when it ended
    for sec in ("concurrency", "queue", "governor", "memory", "rates", "capacity", "status"):
        assert isinstance(s[sec], dict), sec
    assert s["memory"]["rss_bytes"] > 10**7 and s["memory"]["kv_pool_bytes"] == 8192 * 30 * 3 * 64 * 2 * 2  # fp16 K and V
    assert s["rates"]["decode_tok_s_lifetime"] > 0 and s["rates"]["prefill_tok_s_recent"] > 0
    assert s["governor"]["band"] == "green" and s["concurrency"]["decode_batch"] >= 1
    assert s["resident_models"][0]["kind"] == "chat"
    st, h, text = raw(imp_server, "GET", "/v1/metrics?format=prometheus")
    assert st == 200 and h["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert {"imp_concurrency_in_flight", "imp_queue_eta_s", "imp_governor_band", "imp_capacity_max_ctx",
            "imp_rates_decode_tok_s_lifetime", "imp_requests_count"} <= set(fams)
    assert raw(imp_server, "GET", "/v1/metrics?format=xml")[0] == 400


@pytest.mark.slow
def test_ready_probes(imp_server):
    st, _, b = jraw(imp_server, "GET", "/health?ready=1")
    assert st == 200 and b["ready"] is True and b["band"] == "green"
    st, _, b = jraw(imp_server, "GET", "/ready")
    assert st == 200 and b["ready"] is True


@pytest.mark.slow
def test_suspend_drains_refuses_and_resumes(imp_server):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=chat(imp_server, max_tokens=24, ignore_eos=True)))
    t.start()
    deadline = time.monotonic() + 10
    while not jraw(imp_server, "GET", "/v1/metrics")[2]["server"]["requests"] and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        st, _, s = jraw(imp_server, "POST", "/admin/suspend")
        t.join()
        assert st == 200 and s["suspended"] is True and s["drained"] is True and s["in_flight"] == 0
        st, _, r = out["r"]  # admitted before the suspend: it ran to its end, never cancelled
        assert st == 200 and r["usage"]["completion_tokens"] == 24
        st, _, e = chat(imp_server)
        assert st == 503 and e["error"]["code"] == "suspended"
        st, _, h = jraw(imp_server, "GET", "/health")
        assert st == 200 and h["suspended"] is True and h["status"] == "ok"
        st, hd, h = jraw(imp_server, "GET", "/health?ready=1")
        assert st == 503 and h["reason"] == "suspended" and "Retry-After" in hd
        st, _, rd = jraw(imp_server, "GET", "/ready")
        assert st == 503 and rd["code"] == "suspended"
        assert jraw(imp_server, "GET", "/v1/metrics")[2]["server"]["status"]["suspended"] is True
    finally:
        st, _, s = jraw(imp_server, "POST", "/admin/resume")
    assert st == 200 and s["suspended"] is False
    assert chat(imp_server)[0] == 200
    assert jraw(imp_server, "GET", "/ready")[0] == 200
    assert jraw(imp_server, "POST", "/admin/suspend?drain_s=x")[0] == 400


def test_plan_and_estimate_with_replicas():
    """Two data-parallel replicas of 100 blocks: a stream lives in one pool."""
    from imp.http.endpoints.capacity import plan
    from imp.http.pipeline.estimate import estimate

    total = kv(200, used=0)
    p = plan(3, 16 * 60, kv=total, queue=QueueFigures(0, 0, 0), max_context=4096, decode_batch=16, model="m",
             replicas=2)
    assert p["max_context_at_width"] == 50 * 16  # 3 streams over 2 pools: 2 share one pool of 100 blocks
    assert p["max_width_at_depth"] == 2 * (100 // 60) and p["ok"] is False
    full = KvFigures(100, 0, 100, 100, 0, 16)
    empty = KvFigures(100, 100, 0, 0, 0, 16)
    e = estimate(16 * 80, max_tokens=None, n=1, kv=kv(200), bytes_per_token=None, max_context=4096,
                 prefill_tok_s=None, queued_prompt_tokens=0, model="m", replica_kv=[full, empty])
    assert (e["need_blocks"], e["fits_now"], e["fits_drained"]) == (80, True, True)
    e = estimate(16 * 120, max_tokens=None, n=1, kv=kv(200), bytes_per_token=None, max_context=4096,
                 prefill_tok_s=None, queued_prompt_tokens=0, model="m", replica_kv=[full, empty])
    assert (e["fits_now"], e["fits_drained"]) == (False, False)  # 120 blocks: more than one pool holds


@pytest.mark.slow
def test_a_live_row_counts_its_verifies_and_is_null_without_a_drafter(imp_server):
    """GET /v1/metrics' request rows: `speculative` is null for a request without a drafter, else its rounds
    (verify steps), draft tokens fed and kept, and their ratio, growing while it runs."""
    copy = "Repeat this list exactly: " + ", ".join(str(i) for i in range(100, 190))
    for spec in (True, False):
        out, seen = {}, []
        body = {"model": "x", "messages": [{"role": "user", "content": copy}], "max_tokens": 200, "temperature": 0,
                "speculative": spec, "ignore_eos": True}
        t = threading.Thread(target=lambda: out.update(r=jraw(imp_server, "POST", "/v1/chat/completions", body)))
        t.start()
        while t.is_alive():
            seen += jraw(imp_server, "GET", "/v1/metrics")[2]["server"]["requests"]
            time.sleep(0.05)
        t.join()
        assert out["r"][0] == 200 and seen
        # the prefix cache as the request found it on arrival (the capacity reference's `cache` of a row)
        assert all(r["cache"]["tier"] in ("exact", "block", "miss") and r["cache"]["warm_tokens"] % 16 == 0
                   for r in seen)
        if not spec:
            assert all(r["speculative"] is None for r in seen)
            continue
        last = seen[-1]["speculative"]
        assert last["rounds"] > 0 and 0 < last["accepted"] <= last["drafted"], seen[-1]
        assert last["accept_rate"] == round(last["accepted"] / last["drafted"], 3)
        rounds = [r["speculative"]["rounds"] for r in seen]
        assert rounds == sorted(rounds)
