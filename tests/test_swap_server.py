"""Swap instead of recompute through a real server (SmolLM2 on the CPU executor): more long answers at once
than the pool holds, so running requests are preempted; with --preemption-mode swap their KV goes to the
swap area and comes back, and every answer is the one the request gets alone (greedy; the CPU runner is
batch invariant). The scheduler's side is tested against the fake executor in test_scheduler_core."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import urllib.request

import pytest

from tests.serverproc import ServerProcess, call

PROMPTS = [f"Write a long story about a {x} who travels the world. Chapter one:" for x in
           ("cat", "robot", "sailor")]


def _complete(url: str, prompt: str) -> str:
    status, body = call(url, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 400,
                                                "temperature": 0, "ignore_eos": True}, timeout=600)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 400
    return body["choices"][0]["text"]


def _run(url: str) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _complete(url, p), PROMPTS))


@pytest.mark.slow
def test_swapped_requests_give_the_alone_answers_and_replay(smollm2_path, tmp_path):
    # 38 blocks of 16: two requests are admitted (prompt + 256 reserved each), and at 400 tokens each they
    # outgrow the pool: one is preempted, parked, and brought back
    small = ("--kv-cache-tokens", "608", "--max-batch-size", "4")
    with ServerProcess(str(smollm2_path), "--kv-cache-tokens", "8192") as srv:
        alone = [_complete(srv.url, p) for p in PROMPTS]
    log = tmp_path / "swap.log"
    with ServerProcess(str(smollm2_path), *small, "--preemption-mode", "swap", "--event-log", str(log)) as srv:
        swapped = _run(srv.url)
        health = json.load(urllib.request.urlopen(srv.url + "/health", timeout=30))
        metrics = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    assert swapped == alone
    assert health["preemptions"] > 0 and health["swaps"] == health["preemptions"], health
    assert health["kv_swap_blocks"] > 0 and health["kv_swap_blocks_used"] == 0 and health["kv_blocks_used"] == 0
    swaps = float(health["swaps"])
    assert f"imp_kv_swaps_total {swaps}" in metrics and f"imp_kv_swap_ins_total {swaps}" in metrics
    r = subprocess.run([sys.executable, "-m", "imp", "replay", str(log)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    with ServerProcess(str(smollm2_path), *small, "--preemption-mode", "recompute") as srv:
        recomputed = _run(srv.url)
        health = json.load(urllib.request.urlopen(srv.url + "/health", timeout=30))
    assert recomputed == alone and health["preemptions"] > 0 and health["swaps"] == 0
