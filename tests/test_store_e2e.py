"""The Responses store through the real server: a chain survives SIGTERM and a restart, a corrupt
file is a start-up error naming it, 100 concurrent store: true requests are all retrievable, and
the event loop keeps answering /health while the store is stalled."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/responses", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _get(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_stored_chain_survives_sigterm_and_a_restart(smollm2_path, tmp_path):
    from tests.serverproc import ServerProcess

    db = tmp_path / "responses.sqlite3"
    args = ("--responses-store", str(db), "--kv-cache-tokens", "2048")
    with ServerProcess(smollm2_path, *args, log_path=tmp_path / "a.out") as srv:
        r1 = _post(srv.url, {"model": "m", "input": "one", "max_output_tokens": 4})
        r2 = _post(srv.url, {"model": "m", "input": "two", "previous_response_id": r1["id"], "max_output_tokens": 4})
    assert srv.proc.returncode == 0  # SIGTERM: a clean exit, the store flushed
    with ServerProcess(smollm2_path, *args, log_path=tmp_path / "b.out") as srv:
        st, got = _get(srv.url, f"/v1/responses/{r2['id']}")
        assert st == 200 and got["id"] == r2["id"] and got["previous_response_id"] == r1["id"]
        r3 = _post(srv.url, {"model": "m", "input": "three", "previous_response_id": r2["id"], "max_output_tokens": 4})
        assert r3["status"] in ("completed", "incomplete")
        st, items = _get(srv.url, f"/v1/responses/{r1['id']}/input_items")
        assert st == 200 and items["data"][0]["content"][0]["text"] == "one"


def test_a_corrupt_store_file_is_a_start_up_error_naming_it(smollm2_path, tmp_path):
    db = tmp_path / "broken.sqlite3"
    db.write_bytes(b"this is not a database" * 100)
    out = subprocess.run([sys.executable, "-m", "imp", "--model", str(smollm2_path), "--port", "1",
                          "--responses-store", str(db)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert str(db) in out.stderr and "corrupt" in out.stderr


def test_100_concurrent_store_writes_all_retrievable_and_health_stays_fast(smollm2_path, tmp_path):
    import aiohttp

    from tests.serverproc import ServerProcess

    with ServerProcess(smollm2_path, "--responses-store", str(tmp_path / "r.sqlite3"), "--kv-cache-tokens", "8192",
                       log_path=tmp_path / "c.out") as srv:
        async def go():
            gaps = []
            async with aiohttp.ClientSession() as s:
                stop = asyncio.Event()

                async def probe():
                    while not stop.is_set():
                        t = time.monotonic()
                        async with s.get(srv.url + "/health") as r:
                            await r.read()
                        gaps.append(time.monotonic() - t)
                        await asyncio.sleep(0.05)

                async def one(i):
                    async with s.post(srv.url + "/v1/responses", json={"model": "m", "input": f"item {i}",
                                                                       "max_output_tokens": 1}) as r:
                        return (await r.json())["id"]

                p = asyncio.create_task(probe())
                ids = await asyncio.gather(*(one(i) for i in range(100)))
                stop.set()
                await p
                got = await asyncio.gather(*(s.get(srv.url + f"/v1/responses/{rid}") for rid in ids))
                return ids, [r.status for r in got], gaps

        ids, statuses, gaps = asyncio.run(go())
        assert len(set(ids)) == 100 and statuses == [200] * 100
        print(f"/health while 100 store:true requests ran: max {max(gaps) * 1e3:.0f} ms, "
              f"median {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms over {len(gaps)} probes")
        # No timing bound here: on 2 shared cores the burst's own CPU work (100 prefills, the
        # client in the same box) can starve the loop for a second (CI saw 1.07 s once). That
        # the store never blocks the loop is the next test's job, with the store held still.


def test_health_answers_while_the_store_is_held_by_another_writer(smollm2_path, tmp_path):
    """A write lock held from outside stalls every store write for 3 s; /health must keep
    answering inside that window, and the stored responses arrive only after it (so the writes
    really waited). Were a write run on the event loop, no probe could finish in the window."""
    import sqlite3
    import threading

    import aiohttp

    from tests.serverproc import ServerProcess

    db = tmp_path / "held.sqlite3"
    with ServerProcess(smollm2_path, "--responses-store", str(db), "--kv-cache-tokens", "4096",
                       log_path=tmp_path / "d.out") as srv:
        _post(srv.url, {"model": "m", "input": "warm", "max_output_tokens": 1})  # the store file exists
        held = sqlite3.connect(str(db), isolation_level=None, check_same_thread=False)
        held.execute("BEGIN IMMEDIATE")  # the server's writer now waits (busy_timeout 5 s)
        t0 = time.monotonic()
        release_at = t0 + 3.0
        threading.Timer(3.0, held.rollback).start()

        async def go():
            probes, done = [], []
            async with aiohttp.ClientSession() as s:
                stop = asyncio.Event()

                async def probe():
                    while not stop.is_set():
                        async with s.get(srv.url + "/health") as r:
                            await r.read()
                        probes.append(time.monotonic())
                        await asyncio.sleep(0.05)

                async def one(i):
                    async with s.post(srv.url + "/v1/responses", json={"model": "m", "input": f"held {i}",
                                                                       "max_output_tokens": 1}) as r:
                        body = await r.json()
                    done.append(time.monotonic())
                    return r.status, body

                p = asyncio.create_task(probe())
                out = await asyncio.gather(*(one(i) for i in range(10)))
                stop.set()
                await p
                return out, probes, done

        try:
            out, probes, done = asyncio.run(go())
        finally:
            held.close()
        assert all(st == 200 and body["store"] is True for st, body in out), out[:2]
        assert min(done) >= release_at - 0.05  # every reply waited for its COMMIT behind the lock
        inside = [t for t in probes if t0 + 0.5 <= t <= release_at - 0.2]
        print(f"/health answered {len(inside)} times while the store was held ({len(probes)} in all)")
        assert len(inside) >= 3
