"""`python -m imp replay`: a captured log replays identical; a tampered one diverges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec

from imp.log.eventlog import Envelope, EventLog, read_log
from imp.messages import step_result
from imp.messages import DeltaBatch, Enqueue, StepPlan, Submit
from imp.core.replay import main as replay_main

ROOT = Path(__file__).resolve().parent.parent
CAPTURED = ROOT / "replay" / "concurrent-8.log"
CAPTURED_V2 = ROOT / "replay" / "concurrent-8.v2.log"  # written by schema v2: read through the upcasters


def test_captured_concurrent_run_replays_identical(capsys):
    assert CAPTURED.exists(), "replay/concurrent-8.log is part of the repo"
    assert replay_main([str(CAPTURED)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "identical" in out[-1]
    header, envs = read_log(CAPTURED)
    envs = list(envs)
    # it really was concurrent: some step ran several sequences at once
    assert max(len(e.payload.seqs) for e in envs if isinstance(e.payload, StepPlan)) >= 4


def test_cli_entry_point():
    out = subprocess.run([sys.executable, "-m", "imp", "replay", str(CAPTURED)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].endswith("identical")


def test_a_v2_log_is_upcast_and_replays_identical(capsys):
    header, envs = read_log(CAPTURED_V2)
    assert header.schema_version == 2
    envs = list(envs)
    enq = [e.payload for e in envs if isinstance(e.payload, Enqueue)]
    assert enq and all(isinstance(e.submit, Submit) for e in enq)  # v2 restated Submit's fields; v3 wraps it
    assert any(isinstance(e.payload, DeltaBatch) for e in envs)
    assert replay_main([str(CAPTURED_V2)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("identical")


def test_replay_refuses_another_models_log_and_a_gap(tmp_path, capsys):
    assert replay_main([str(CAPTURED)], expect_fingerprint="0" * 64) == 2
    assert "refusing to replay it against another model" in capsys.readouterr().err
    header, envs = read_log(CAPTURED)
    envs = list(envs)
    gap = tmp_path / "gap.log"
    log = EventLog(gap)
    log.open(header)
    for e in envs[:10] + envs[11:]:
        log.append(e)
    log.close()
    assert replay_main([str(gap)]) == 2
    assert f"sequence gap: seq {envs[11].seq} follows seq {envs[9].seq}" in capsys.readouterr().err
    # a header whose fingerprint disagrees with the KV allocator's config: inconsistent
    bad = tmp_path / "fp.log"
    log = EventLog(bad)
    log.open(msgspec.structs.replace(header, fingerprint="1" * 64))
    log.close()
    assert replay_main([str(bad)]) == 2 and "inconsistent" in capsys.readouterr().err


def test_replay_cli_checks_the_named_model(smollm2_path):
    out = subprocess.run([sys.executable, "-m", "imp", "replay", str(CAPTURED), "--model", str(smollm2_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].endswith("identical"), out.stderr


def _tampered(tmp_path: Path) -> tuple[Path, int]:
    header, envs = read_log(CAPTURED)
    envs = list(envs)
    log = EventLog(tmp_path / "bad.log")
    log.open(header)
    target = None
    for e in envs:
        if target is None and isinstance(e.payload, StepPlan) and len(e.payload.seqs) >= 2:
            # the scheduler "decided" one sequence fewer: a decision the cores never make
            e = Envelope(e.seq, e.sender, e.receiver, e.step, e.wall_ns,
                         msgspec.structs.replace(e.payload, seqs=e.payload.seqs[:-1]))
            target = e.seq
        log.append(e)
    log.close()
    return tmp_path / "bad.log", target


def test_tampered_log_reports_first_divergence(tmp_path, capsys):
    bad, seq = _tampered(tmp_path)
    assert replay_main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"DIVERGENCE at seq {seq} (scheduler)" in out


def test_a_router_run_dumps_to_a_replayable_log(tmp_path, capsys):
    """What a failing hypothesis case saves replays identical (and steps)."""
    from imp.core.router import Router, dump
    from imp.config import ServerConfig
    from imp.engine.cores import build_cores
    from imp.messages import SamplingParams, SampledToken, StepResult, Submit

    cores = build_cores(ServerConfig(max_batch_size=4, max_step_tokens=32), 16, 256, "fp")
    router = Router({c.name: c for c in cores})
    p = SamplingParams(max_tokens=3, seed=1)
    outs = router.send([("ingress", "admission", Submit(f"r{i}", tuple(range(5 + i)), p, i)) for i in range(3)])
    for step in range(1, 50):
        plans = [d.msg for d in outs if isinstance(d.msg, StepPlan)]
        if not plans:
            break
        toks = [SampledToken(w.seq_id, 7) for w in plans[0].shares() if w.sample]
        outs = router.send([("executor", "scheduler", step_result(plans[0], tuple(toks), 100 + step))])
    dump(router, tmp_path / "case.log", note="test")
    assert replay_main([str(tmp_path / "case.log"), "--step"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].endswith("identical") and any("StepPlan" in line for line in out)
