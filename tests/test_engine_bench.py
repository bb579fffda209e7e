"""bench/engine.py (the engine without HTTP, issue 33) runs end to end on the tiny random model and
its figures add up: every request finishes with its answer, the step kinds cover what the workload
needs (prefill, decode, and both in one step once requests are replaced), and the bound is computed
from the runner's measured rates. Marked slow: it compiles the tiny model's kernels (~30 s cold)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serverproc import ROOT

pytestmark = pytest.mark.slow


def test_engine_bench_on_the_tiny_model(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "bench/engine.py", "--model", "tiny", "--streams", "1,4", "--prompt", "40",
                        "--answer", "12", "--rounds", "2", "--threads", "1", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| streams | tok/s | bound tok/s |" in r.stdout, r.stdout
    rows = {row["streams"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {1, 4}
    for C, row in rows.items():
        assert row["failed"] == 0 and row["requests"] == 2 * C
        assert row["tokens"] == 2 * C * 12  # every answer in full (ignore_eos)
        assert row["tok_s"] > 0 and row["runner_prefill_tok_s"] > 0 and row["runner_decode_tok_s"] > 0
        assert row["cpu_us_token"] > 0
        assert 0 < row["bound_tok_s"] < row["runner_decode_tok_s"]  # a prompt share costs something
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] <= row["itl_p99_ms"]
        steps = row["steps"]
        assert steps["decode-only"]["steps"] > 0
        assert steps["prefill-only"]["steps"] + steps["mixed"]["steps"] >= 1
    # four streams refilled as they finish: a new prompt's chunk joins running decode rows
    assert rows[4]["steps"]["mixed"]["steps"] >= 1


def test_host_cores_bench_runs_every_answer_to_its_end():
    """bench/host_cores.py: the cores and the executor's bookkeeping without a model; every stream's answer whole,
    refilled until C x rounds finished, and a CPU figure a token."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import host_cores
    finally:
        sys.path.remove(str(ROOT / "bench"))
    cpu, tokens, steps = host_cores.level(8, 2, 40, 12)
    assert tokens == 8 * 2 * 12 and cpu > 0
    assert 12 <= steps < 8 * 2 * 12  # rows batched: fewer steps than tokens
