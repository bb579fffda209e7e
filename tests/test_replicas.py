"""Data parallelism: admission spreads requests over scheduler replicas, sends
each request's cancels to its replica and keeps sessions where their pins are;
replicated cores run to completion and replay identically; the real server
with --data-parallel 2 (CPU) answers like one replica."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.log.eventlog import Envelope, LogHeader
from imp.core.replicas import Routed, pick, split_name
from imp.core.router import Router
from imp.config import ServerConfig, replica_devices
from imp.engine.cores import build_cores
from imp.messages import step_result
from imp.messages import (
    PENDING_TOKEN, Cancel, EndThinking, Enqueue, Finished, FinishReason, SampledToken, SamplingParams, SessionClose,
    StepPlan, StepResult, Submit, TokenBatch,
)
from imp.core.replay import replay


def _submit(rid, n_prompt=8, session="", max_tokens=8):
    return Submit(rid, tuple(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), 0, session_id=session)


def test_admission_picks_the_least_loaded_replica_and_follows_it():
    adm = AdmissionCore(AdmissionConfig(num_blocks=64, block_size=4, replicas=3))
    to = {}
    for rid, n in (("a", 40), ("b", 8), ("c", 8), ("d", 8)):
        [(recv, m)] = adm.handle("ingress", _submit(rid, n))
        assert isinstance(m, Enqueue)
        to[rid] = recv
    assert to == {"a": "scheduler.0", "b": "scheduler.1", "c": "scheduler.2", "d": "scheduler.1"}
    assert adm.handle("ingress", Cancel("c")) == [("scheduler.2", Cancel("c"))]
    assert adm.handle("ingress", EndThinking("a", (1,))) == [("scheduler.0", EndThinking("a", (1,)))]
    for rid in ("b", "d"):
        adm.handle("scheduler.1", Finished(rid, FinishReason.STOP))
    assert adm.loads[1] == 0 and adm.handle("ingress", Cancel("b")) == []
    # a session stays on the replica holding its pinned prompt, however loaded
    [(r1, _)] = adm.handle("ingress", _submit("s1", 8, session="chat"))
    adm.handle(r1, Finished("s1", FinishReason.STOP))
    adm.handle("ingress", _submit("big", 60))
    [(r2, _)] = adm.handle("ingress", _submit("s2", 8, session="chat"))
    assert r2 == r1
    assert adm.handle("ingress", SessionClose("chat")) == [(r1, SessionClose("chat"))]
    assert len(adm.handle("ingress", SessionClose("unknown"))) == 3  # nobody knows it: every replica


def test_one_replica_keeps_the_plain_names():
    adm = AdmissionCore(AdmissionConfig(num_blocks=64, block_size=4))
    assert adm.handle("ingress", _submit("a"))[0][0] == "scheduler"
    assert pick([3, 1, 1]) == 1 and pick([0, 0], session_replica=1) == 1
    assert split_name("kv.12") == ("kv", 12) and split_name("kv") == ("kv", None)
    assert replica_devices(ServerConfig(device="cuda:2", data_parallel=3)) == ["cuda:2", "cuda:3", "cuda:4"]
    assert replica_devices(ServerConfig(data_parallel=2)) == ["cpu", "cpu"]


def _fake_token(seq_id: str, gen_index: int) -> int:
    return 3 + int.from_bytes(hashlib.sha256(f"{seq_id}/{gen_index}".encode()).digest()[:2], "little") % 200


@pytest.mark.parametrize("depth", [1, 2])
def test_replicated_cores_finish_everything_and_replay(depth):
    cfg = ServerConfig(max_batch_size=4, max_step_tokens=32, pipeline_depth=depth)
    adm, schs, kvs = build_cores(cfg, 24, 256, "fake", replicas=2)
    assert [c.name for c in schs] == ["scheduler.0", "scheduler.1"] and isinstance(kvs[1], Routed)
    cores = {c.name: c for c in (adm, *schs, *kvs)}
    router = Router(cores)
    plans: dict[str, list[StepPlan]] = {"executor.0": [], "executor.1": []}
    last: dict[str, dict[str, int]] = {"executor.0": {}, "executor.1": {}}
    tokens: dict[str, list[int]] = {}

    def collect(deliveries):
        for d in deliveries:
            if isinstance(d.msg, StepPlan):
                plans[d.receiver].append(d.msg)
            elif isinstance(d.msg, TokenBatch):
                for t in d.msg.each():
                    tokens.setdefault(t.req_id, []).extend(t.token_ids)

    for i in range(10):
        collect(router.send([("ingress", "admission", _submit(f"r{i}", 5 + 3 * i, max_tokens=6))]))
    used = {r: bool(p) for r, p in plans.items()}
    while any(plans.values()):
        for ex, queue in plans.items():  # the two executors take turns, each in its own plan order
            if not queue:
                continue
            plan = queue.pop(0)
            out = []
            for w in plan.shares():
                assert all(t != PENDING_TOKEN for t in w.token_ids) or last[ex].get(w.seq_id) is not None
                if w.sample:
                    out.append(SampledToken(w.seq_id, _fake_token(w.seq_id, w.gen_index)))
            last[ex] = {t.seq_id: t.token_id for t in out}
            collect(router.send([(ex, f"scheduler.{split_name(ex)[1]}", step_result(plan, tuple(out), 1))]))
    assert used == {"executor.0": True, "executor.1": True}  # both replicas got work
    assert tokens == {f"r{i}": [_fake_token(f"r{i}#0", g) for g in range(6)] for i in range(10)}
    for k in kvs:
        assert k.figures().used == 0
    header = LogHeader(1, "fake", {name: msgspec.to_builtins(c.config) for name, c in cores.items()})
    envs = [Envelope(d.seq, d.sender, d.receiver, 0, 0, d.msg) for d in router.log]
    res = replay(header, envs)
    assert res.divergence is None and res.decisions["scheduler.1"] > 0


@pytest.mark.slow
def test_server_data_parallel_2_on_cpu(smollm2_path, tmp_path):
    import concurrent.futures
    import json
    import subprocess
    import sys
    import urllib.request

    from tests.serverproc import ServerProcess

    def post(url, body):
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    log = tmp_path / "events.log"
    srv = ServerProcess(smollm2_path, "--data-parallel", "2", "--pipeline-depth", "2", "--kv-cache-tokens", "4096",
                        "--event-log", str(log), log_path=tmp_path / "server.out")
    with srv:
        prompts = [f"Write a sentence about the number {i}." for i in range(6)]

        def complete(p):
            body = dict(model="smollm2", prompt=p, max_tokens=12, temperature=0)
            return post(srv.url + "/v1/completions", body)["choices"][0]["text"]

        alone = [complete(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            together = list(ex.map(complete, prompts))
        assert together == alone
        with urllib.request.urlopen(srv.url + "/health") as r:
            h = json.loads(r.read())
        assert h["kv_blocks_total"] == 2 * 256 and (h["kv_blocks_used"], h["kv_blocks_reserved"]) == (0, 0)
    r = subprocess.run([sys.executable, "-m", "imp", "replay", str(log)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr
    assert "scheduler.1" in r.stdout and "kv.1" in r.stdout
