"""The prefix cache's disk tier in the allocator (imp.core.kv, KvConfig.tier_blocks), driven by the fake
executor of test_scheduler_core (its KV memory checks every position each sequence attends to, so a block
filled from the tier with the wrong content fails the run): write-through, loads that wait, a restart with
the same files, a file that fails to load, the size limit."""

from __future__ import annotations

import os
import random

from imp.messages import KvStored
from tests.test_scheduler_core import Sim, ids, params

PROMPT = ids(61, base=3)  # 15 full blocks of 4


def _run(sim: Sim, name: str, prompt=PROMPT, max_tokens=6):
    sim.submit(name, prompt, params(max_tokens=max_tokens, seed=5, ignore_eos=True))
    sim.drain()
    assert sim.output(name) == sim.expected(name, 0)
    return sim.finish[(name, 0)]


def _evict(sim: Sim):
    for i in range(6):  # other prompts through the small pool: the first prompt's blocks are evicted
        _run(sim, f"other{i}", ids(30, base=40 + i))


def test_evicted_blocks_come_back_from_the_tier():
    sim = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200)
    assert _run(sim, "a").cached_tokens == 0
    assert sim.kv.tier_saves >= 15 and len(sim.disk) == sim.kv.tier_saves
    _evict(sim)
    assert sim.kv.evictions > 0
    fin = _run(sim, "b")  # the same prompt: its blocks from the tier, the KV checked position by position
    assert fin.cached_tokens == 60 and sim.kv.tier_hits >= 15
    sim.kv.audit()
    assert sim.figures.kv.used == 0


def test_a_restart_with_the_same_files_starts_warm():
    first = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200)
    _run(first, "a")
    disk = dict(first.disk)
    sim = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200, disk=disk)
    sim._collect(sim.router.send([("engine", "kv", KvStored(tuple(disk)))]))  # the boot scan
    assert _run(sim, "b").cached_tokens == 60 and sim.kv.tier_hits >= 15 and sim.kv.tier_saves <= 1  # (the answer fills one)
    cold = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200)
    assert _run(cold, "b").cached_tokens == 0  # without the files: computed


def test_a_file_that_fails_to_load_is_computed_again_and_written_again():
    first = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200)
    _run(first, "a")
    disk = dict(first.disk)
    sim = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200, disk=disk)
    sim._collect(sim.router.send([("engine", "kv", KvStored(tuple(disk)))]))
    bad = list(disk)[7]  # the 8th block's file is corrupt: blocks 0-6 load, the rest is computed
    sim.spoil.add(bad)
    fin = _run(sim, "b")
    assert fin.cached_tokens == 28 and sim.kv.tier_misses == 1
    assert bad in sim.kv.stored  # computed, cached and written through again
    sim.kv.audit()


def test_the_tier_keeps_its_size_dropping_the_least_recently_used():
    sim = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=20)
    _run(sim, "a")
    _evict(sim)
    assert len(sim.kv.stored) <= 20 and len(sim.disk) <= 20 and sim.kv.tier_drops > 0
    _run(sim, "b")  # some of its blocks were dropped: what is left loads, the rest is computed
    sim.kv.audit()


# --------------------------------------------------------------------------- a real server, restarted


def _chat(url: str, sysmsg: str) -> dict:
    import json
    import urllib.request

    body = {"model": "m", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": sysmsg}, {"role": "user", "content": "Say hi."}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def test_a_restarted_server_reads_the_prompt_back_and_ignores_foreign_and_corrupt_files(smollm2_path, tmp_path):
    """--prompt-cache-dir: a second server on the same directory finds a long system prompt on disk (the same
    answer, every full block a cache hit); a corrupt file and another model's are ignored with a log line; an
    unwritable directory is one warning and a server that serves."""
    import pytest

    from tests.serverproc import ServerProcess

    pytest.importorskip("openai")  # the server lane's extra is installed
    sysmsg = " ".join(f"Rule {i}: answer about topic {i} with care, citing section {i * 7}." for i in range(40))
    cache = tmp_path / "pc"
    logs = [tmp_path / f"server{i}.out" for i in range(3)]
    with ServerProcess(str(smollm2_path), "--prompt-cache-dir", str(cache), "--event-log",
                       str(tmp_path / "ev0.log"), log_path=logs[0]) as srv:
        cold = _chat(srv.url, sysmsg)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (sub,) = [d for d in cache.iterdir() if d.is_dir()]
    files = sorted(sub.glob("*.kv"))
    n_full = (cold["usage"]["prompt_tokens"] - 1) // 16
    assert len(files) >= n_full
    foreign = cache / "0123456789abcdef-float16_1x16x1x64"  # another model's directory: never read
    foreign.mkdir()
    (foreign / files[0].name).write_bytes(b"x" * 100)
    by_age = sorted(files, key=lambda p: p.stat().st_mtime_ns)  # written in chain order, one after another
    k = n_full // 2
    data = bytearray(by_age[k].read_bytes())
    data[-7] ^= 0xFF  # block k's file corrupt: blocks 0..k-1 are read, k and what follows are computed
    by_age[k].write_bytes(bytes(data))
    with ServerProcess(str(smollm2_path), "--prompt-cache-dir", str(cache), "--event-log",
                       str(tmp_path / "ev1.log"), log_path=logs[1]) as srv:
        warm = _chat(srv.url, sysmsg)
        again = _chat(srv.url, sysmsg)
        import json
        import urllib.request

        health = json.load(urllib.request.urlopen(srv.url + "/health", timeout=30))
        metrics = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    # every file before the corrupt one was read into the pool, and those past it too (a later prompt may use
    # them) unless the warm request computed them first: a clock tick retries its alloc once the corrupt block's
    # read failed, while the reads past it are still on their way (a slow box: CI saw 48 of 50) -- each lands
    # on a cached block and counts neither as a hit nor as a miss
    hits = health["kv_tier_hits"]
    assert k <= hits <= n_full - 1 and health["kv_tier_misses"] == 1 and health["kv_tier_blocks"] >= n_full, health
    assert f"imp_kv_tier_hits_total {float(hits)}" in metrics and "imp_kv_tier_misses_total 1.0" in metrics
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == k * 16
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n_full * 16
    out = logs[1].read_text()
    assert "blocks of this model's KV on disk" in out and "another model's or layout's cache, not read" in out
    assert "corrupt, not used" in out
    import re

    assert re.search(r"\[tier\] \d+ blocks \([0-9.]+ GB\) loaded in [0-9.]+ s: reads", out)  # a line a burst
    ro = tmp_path / "ro"
    ro.write_text("a file where the directory should be")
    with ServerProcess(str(smollm2_path), "--prompt-cache-dir", str(ro / "sub"), log_path=logs[2]) as srv:
        assert _chat(srv.url, "Be brief.")["choices"][0]["message"]["content"]
    assert "no disk tier" in logs[2].read_text()
    import subprocess
    import sys

    for ev in ("ev0.log", "ev1.log"):  # the tier's messages are on the log: both runs replay identically
        r = subprocess.run([sys.executable, "-m", "imp", "replay", str(tmp_path / ev)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_the_tier_files_refuse_what_is_not_theirs(tmp_path, caplog):
    """KvTier on its own: a round trip; a stale format, another fingerprint, another layout, a short file and a
    flipped byte are each not used (one log line, the file removed); a directory that cannot be made is
    TierUnavailable; a failing write says so once and returns False."""
    import logging

    import pytest

    from imp.actors import kvtier

    t = kvtier.KvTier(tmp_path, "a" * 64, "float16:2x16x1x8")
    key, payload = bytes(range(32)), random.Random(1).randbytes(16384) + b"tail"  # 4 pages and a tail
    assert t.save(key, payload) and bytes(t.load(key, len(payload))) == payload and t.scan() == (key,)
    buf = bytearray(len(payload))  # read into a caller's buffer (a GPU's pinned staging buffer)
    assert t.load(key, len(payload), into=buf) is buf and bytes(buf) == payload
    assert t.load(key, len(payload) - 4, into=bytearray(len(payload) - 4)) is None  # not this size: not used
    t.save(key, payload)
    path = t._path(key)
    good = path.read_bytes()
    page = len(good) - len(payload) + 4096  # where the payload's second 4 KB page starts
    other = kvtier.KvTier(tmp_path / "o", "b" * 64, "float16:2x16x1x8")
    other.save(key, payload)
    lay = kvtier.KvTier(tmp_path / "l", "a" * 64, "float32:2x16x1x8")
    lay.save(key, payload)
    cases = [("stale", b"IMPKV\x02\x00\x00" + good[8:]),  # (the CRC-32 format)
             ("foreign (another model", other._path(key).read_bytes()),
             ("foreign (another KV", lay._path(key).read_bytes()),
             ("short", good[:40]), ("corrupt", good[:-1] + bytes([good[-1] ^ 1])),
             ("corrupt", good[:page - 4096] + good[page:page + 4096] + good[page - 4096:page] + good[page + 4096:]),
             ("corrupt", good[:page] + bytes(4096) + good[page + 4096:])]  # two pages swapped, a page zeroed
    with caplog.at_level(logging.WARNING, logger="imp.kvtier"):
        for why, data in cases:
            assert data != good
            path.write_bytes(data)
            caplog.clear()
            assert t.load(key, len(payload)) is None, why
            assert why in caplog.text and not path.exists(), why
            path.write_bytes(data)
            assert t.load(key, len(payload), into=bytearray(len(payload))) is None, why
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(kvtier.TierUnavailable):
        kvtier.KvTier(blocker / "sub", "a" * 64, "x")
    t.dir.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="imp.kvtier"):
            caplog.clear()
            results = [t.save(bytes([i]) * 32, payload) for i in range(3)]
        if os.geteuid() != 0:  # root writes anyway
            assert results == [False] * 3 and caplog.text.count("cannot write the prompt cache") == 1
    finally:
        t.dir.chmod(0o700)


def test_the_host_tier_keeps_the_newest_blocks_in_front_of_the_disk(tmp_path):
    """KvTier's host memory: a load finds a block there first ("host"), else on disk ("disk", and keeps it in
    host memory); the oldest leave host memory past host_blocks (their files stay); a drop leaves both; without
    a directory the host tier stands alone (and scan finds nothing: it does not outlive the process)."""
    from imp.actors import kvtier

    keys = [bytes([i]) * 32 for i in range(4)]
    pay = {k: bytes([i]) * 64 for i, k in enumerate(keys)}
    t = kvtier.KvTier(tmp_path, "a" * 64, "float16:1x1x1x32", host_blocks=2)
    for k in keys:
        assert t.save(k, lambda k=k: pay[k])  # (a device copy in flight: a function that returns the bytes)
    assert list(t.host) == keys[2:] and len(t.scan()) == 4
    assert t.fetch(keys[3], 64) == (pay[keys[3]], "host") and t.host_hits == 1
    got, src = t.fetch(keys[0], 64)
    assert (bytes(got), src) == (pay[keys[0]], "disk") and list(t.host) == [keys[3], keys[0]]
    assert t.fetch(keys[0], 64)[1] == "host"
    assert t.fetch(keys[0], 32) == (None, "")  # a size that is not this layout's: not used
    t.drop(keys[0])
    assert keys[0] not in t.host and t.fetch(keys[0], 64) == (None, "")
    alone = kvtier.KvTier(None, "a" * 64, "float16:1x1x1x32", host_blocks=3)
    for k in keys:
        assert alone.save(k, pay[k])
    assert alone.scan() == () and alone.fetch(keys[0], 64) == (None, "") and alone.fetch(keys[1], 64)[1] == "host"


def test_a_server_with_a_host_tier_brings_evicted_prompts_back_without_files(smollm2_path, tmp_path):
    """--host-cache-gb alone (no directory): a long system prompt evicted from a small pool by others comes
    back from host memory as cache hits, with the same answer; the host hits and bytes are counted."""
    import json
    import urllib.request

    import pytest

    from tests.serverproc import ServerProcess

    pytest.importorskip("openai")
    sysmsg = " ".join(f"Rule {i}: answer about topic {i} with care, citing section {i * 7}." for i in range(40))
    with ServerProcess(str(smollm2_path), "--host-cache-gb", "0.5", "--kv-cache-tokens", "1024",
                       log_path=tmp_path / "host.out") as srv:
        first = _chat(srv.url, sysmsg)
        for i in range(3):  # other long prompts through the small pool: the first one's blocks are evicted
            _chat(srv.url, " ".join(f"Note {i}-{j}: a different text about item {j * 3}." for j in range(60)))
        again = _chat(srv.url, sysmsg)
        health = json.load(urllib.request.urlopen(srv.url + "/health", timeout=30))
        metrics = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    n_full = (first["usage"]["prompt_tokens"] - 1) // 16
    assert health["kv_evictions"] > 0 and health["kv_tier_hits"] >= n_full
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n_full * 16
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    host_hits = next(float(x.split()[1]) for x in metrics.splitlines() if x.startswith("imp_kv_tier_host_hits_total"))
    read = next(float(x.split()[1]) for x in metrics.splitlines() if x.startswith("imp_kv_tier_read_bytes_total"))
    assert host_hits == health["kv_tier_hits"] and read > 0
    assert not list(tmp_path.glob("**/*.kv"))


def test_a_demoting_tier_is_written_only_as_the_pool_evicts():
    """tier_demote (a host tier alone): nothing is written while the pool holds the prompt; the blocks the pool
    evicts go to the tier just before they are written over (the fake executor copies them then, so a wrong
    order fails its KV check on the way back), and the prompt comes back from the tier."""
    sim = Sim(num_blocks=24, block_size=4, max_context=128, max_step_tokens=64, tier_blocks=200, tier_demote=True)
    assert _run(sim, "a").cached_tokens == 0 and sim.kv.tier_saves == 0 and not sim.disk
    assert _run(sim, "again").cached_tokens == 60 and sim.kv.tier_saves == 0  # the pool still holds it
    _evict(sim)
    assert sim.kv.evictions > 0 and sim.kv.tier_saves == sim.kv.evictions - sim.kv.tier_hits
    fin = _run(sim, "b")
    assert fin.cached_tokens == 60 and sim.kv.tier_hits >= 15
    sim.kv.audit()
    assert sim.figures.kv.used == 0


def test_a_chain_longer_than_the_pool_can_hold_beside_a_pin_is_computed_not_loaded_forever():
    """Found by the scheduler machine: a prompt whose chain is on the tier but needs more blocks than the pool
    has beside a session pin loaded one block a round, evicting the one loaded before (a livelock). After
    TIER_ROUNDS rounds the alloc computes what is missing (the pin yields to it)."""
    from tests.test_scheduler_core import MS

    sim = Sim(8, 4, max_context=48, max_batch_size=1, max_step_tokens=1, aging_ns=5 * MS, decode_reserve=1,
              tier_blocks=200)

    def sub(n, length, family, nn=1, session=""):
        sim.submit(f"q{n}", ids(length, base=family * 10), params(1, seed=n * 7), n=nn, session_id=session)

    sub(1, 1, 0)
    sub(2, 1, 0)
    sub(3, 27, 1, nn=2)
    sim.cancel("q2", -1)
    sim.step()
    sub(4, 15, 0, session="s1")
    sim.drain(limit=3000)
    sim.kv.audit()
    assert set(sim.finished) == set(sim.enqueued) and not sim.kv.tier_rounds


def test_the_null_runner_has_tiers_of_the_block_size_it_is_given(smollm2_path, tmp_path):
    """bench/prompt_cache.py --null-kv-bytes: no model math, tier blocks of N bytes read back through the real
    files, messages and allocator after a restart (the restart's host side timed without a GPU)."""
    import json
    import urllib.request

    from tests.serverproc import ServerProcess

    env = {"IMP_NULL_RUNNER": "1", "IMP_NULL_KV_BYTES": "65536"}
    ids = list(range(300, 300 + 200))
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0}).encode()

    def ask(url):
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)["usage"]["prompt_tokens_details"]["cached_tokens"]

    cache, log = tmp_path / "pc", tmp_path / "s1.out"
    with ServerProcess(str(smollm2_path), "--prompt-cache-dir", str(cache), env=env) as srv:
        assert ask(srv.url) == 0
    files = list(cache.glob("*/*.kv"))
    assert len(files) == 12 and {f.stat().st_size for f in files} == {65536 + 192}  # 199 // 16 full blocks
    with ServerProcess(str(smollm2_path), "--prompt-cache-dir", str(cache), env=env, log_path=log) as srv:
        assert ask(srv.url) == 192
    assert "[tier] 12 blocks (0.00 GB) loaded in" in log.read_text()


def _restarted_and_loading(cfg, toks, seq: str):
    """A KV core after a restart whose tier holds toks' full blocks (written by another core), and `seq`'s alloc of
    toks asking for all of them: (the core, the blocks' keys, the KvLoads in flight)."""
    from imp.core.kv import KvCore
    from imp.messages import KvLoad, KvOp, KvRequest

    first = KvCore(cfg)
    first.handle("scheduler", KvRequest(1, (KvOp("alloc", "a", len(toks), toks),)))
    saves = first.handle("scheduler", KvRequest(2, (KvOp("free", "a", token_ids=toks),)))
    keys = tuple(m.key for to, m in saves if to == "executor")
    kv = KvCore(cfg)
    kv.handle("engine", KvStored(keys))
    out = kv.handle("scheduler", KvRequest(1, (KvOp("alloc", seq, len(toks), toks),)))
    loads = [m for to, m in out if isinstance(m, KvLoad)]
    assert [m.key for m in loads] == list(keys) and out[-1][1].results[0].loading
    return kv, keys, loads


def test_a_load_that_lands_on_a_block_computed_meanwhile_is_neither_hit_nor_miss():
    """A restart whose 4th file is corrupt: the alloc asks for all 8 blocks; once block 3's read failed, a retry
    (a clock tick un-stalls the scheduler) computes blocks 3.. while the reads past 3 are still on their way. Those
    land on blocks already cached: released, counted neither as hits nor as misses, and the pool stays whole (the
    server test's hit count depends on this timing)."""
    from imp.core.kv import KvConfig
    from imp.messages import KvLoaded, KvOp, KvRequest

    toks = tuple(range(3, 3 + 4 * 8 + 1))  # 8 full blocks of 4 and the last token's
    cfg = KvConfig(num_blocks=32, block_size=4, tier_blocks=100)
    kv, keys, loads = _restarted_and_loading(cfg, toks, "b")
    for m in loads[:4]:  # 0-2 read, 3 corrupt
        kv.handle("executor", KvLoaded(m.key, m.block, m.key != keys[3]))
    (res,) = kv.handle("scheduler", KvRequest(2, (KvOp("alloc", "b", len(toks), toks),)))[-1][1].results
    assert res.ok and res.cached_tokens == 12  # the retry: 0-2 cached, 3.. computed
    kv.handle("scheduler", KvRequest(3, (KvOp("grow", "b", len(toks), toks[12:]),)))  # 3..7 written: cache entries
    for m in loads[4:]:
        kv.handle("executor", KvLoaded(m.key, m.block, True))
    assert (kv.tier_hits, kv.tier_misses) == (3, 1) and not kv.loading
    kv.handle("scheduler", KvRequest(4, (KvOp("free", "b", token_ids=()),)))
    kv.audit()
    assert len(kv.clean) + len(kv.lru) == cfg.num_blocks


def test_a_block_that_lands_from_the_tier_while_another_sequence_promised_it_is_no_longer_promised():
    """share_in_flight with a tier: "y" asks the tier for a prompt's blocks; "x" (done waiting for the tier: its
    TIER_ROUNDS spent, as after two rounds of failed reads) allocates the same prompt meanwhile and promises to
    compute those blocks. When the reads land the blocks are cache entries: the promises go with them, as when a
    promised block is written (found by the scheduler machine: "a cached block is still promised")."""
    from imp.core.kv import TIER_ROUNDS, KvConfig
    from imp.messages import KvLoaded, KvOp, KvRequest

    toks = tuple(range(3, 3 + 4 * 4 + 1))  # 4 full blocks of 4 and the last token's
    cfg = KvConfig(num_blocks=32, block_size=4, tier_blocks=100, share_in_flight=True)
    kv, keys, loads = _restarted_and_loading(cfg, toks, "y")
    kv.tier_rounds["x"] = TIER_ROUNDS
    (res,) = kv.handle("scheduler", KvRequest(2, (KvOp("alloc", "x", len(toks), toks),)))[-1][1].results
    assert res.ok and res.cached_tokens == 0 and set(kv.promised) == set(keys)
    for m in loads:
        kv.handle("executor", KvLoaded(m.key, m.block, True))
    kv.audit()
    assert not kv.promised and not kv.seqs["x"].promises
    (res,) = kv.handle("scheduler", KvRequest(3, (KvOp("alloc", "y", len(toks), toks),)))[-1][1].results
    assert res.ok and res.cached_tokens == 16  # y: the blocks from the tier, no wait for x
    kv.handle("scheduler", KvRequest(4, (KvOp("free", "x", token_ids=toks), KvOp("free", "y", token_ids=toks[16:]))))
    kv.audit()
