"""The fleet's shell (imp.engine.fleet) over fake engines: leases, drains that never cancel, one swap at a
time, a failed load restoring what it unloaded, adapters dropped on a swap, idle unloads. The budget's
decisions themselves are test_residency's; the real thing through HTTP is test_models_server's."""

from __future__ import annotations

import asyncio
import logging

import pytest

from imp.core.residency import Budget
from imp.engine.catalog import Catalog, Entry
from imp.engine.fleet import Fleet
from imp.engine.port import ModelRefused
from imp.engine.port import LoraInfo, ResumeResult, SuspendResult
from imp.messages import MemoryState

MB = 2**20


class FakeEngine:
    store = None

    def __init__(self, name: str, log: list):
        self.name, self.log, self.fault, self.loaded = name, log, None, True
        self.adapters: dict[int, LoraInfo] = {}
        self.card = type("Card", (), {"name": name, "path": f"/m/{name}.gguf"})()

    async def release(self, reason):
        self.log.append(("release", self.name, reason))
        self.loaded = False
        return [MemoryState("executor", False, reason, 0.0, rss_before=200 * MB, rss_after=100 * MB)]

    async def reload(self):
        await asyncio.sleep(0.01)
        self.log.append(("reload", self.name))
        self.loaded = True
        return [MemoryState("executor", True, "resume", 0.0)]

    def loras(self):
        return tuple(self.adapters.values())

    def lora_named(self, name):
        return next((i for i, a in self.adapters.items() if a.name == name), None)

    async def lora_unload(self, lid, name, drain_s=30.0):
        return self.adapters.pop(lid)

    async def drain(self, timeout_s):
        return 0

    async def suspend(self, drain_s):
        self.log.append(("suspend", self.name))
        self.loaded = False
        return SuspendResult(suspended=True, drained=True, in_flight=0, kv_released=True)

    async def resume(self, reload=True):
        self.log.append(("resume", self.name, reload))
        self.loaded = self.loaded or reload
        return ResumeResult(suspended=False, reloaded=reload)

    async def stop(self):
        self.log.append(("stop", self.name))

    async def metrics_text(self):
        return f"# HELP imp_requests_total r\n# TYPE imp_requests_total counter\nimp_requests_total 1.0\n".encode()


def _fleet(budget_mb=250, fail=(), drain_s=0.5, idle_s=0.0, entries=None):
    log: list = []
    entries = entries or {n: Entry(n, f"/m/{n}.gguf", 100 * MB) for n in "abc"}

    async def build(entry):
        await asyncio.sleep(0.02)
        log.append(("build", entry.name))
        if entry.name in fail:
            raise ValueError(f"{entry.name}: not a GGUF")
        e = FakeEngine(entry.name, log)
        return e, f"text-{entry.name}", None

    first = entries["a"]
    f = Fleet(Catalog(tuple(entries.values())), Budget(0, budget_mb * MB), build, first,
              (FakeEngine("a", log), "text-a", None), on_gpu=False, drain_s=drain_s, idle_s=idle_s)
    return f, log


def run(coro):
    return asyncio.run(coro)


def test_a_request_loads_its_model_and_the_least_recently_used_idle_one_goes():
    async def go():
        f, log = _fleet()
        async with f.use("b") as m:
            assert m.text == "text-b" and m.leases == 1
        assert [n for n, x in f.models.items() if x.loaded] == ["a", "b"]
        async with f.use("c"):
            pass
        assert [n for n, x in f.models.items() if x.loaded] == ["b", "c"]
        assert ("release", "a", "model-swap") in log
        assert f.models["a"].footprint.host == 100 * MB and f.models["a"].measured  # the larger: estimate, freed
        async with f.use("a"):  # back by a reload of its own engine, not a second build
            pass
        assert log.count(("build", "a")) == 0 and ("reload", "a") in log
        assert {n for n, x in f.models.items() if x.loaded} == {"c", "a"}
        with pytest.raises(ModelRefused) as e:
            f.resolve("nope")
        assert e.value.status == 404 and e.value.code == "model_not_found" and "a, b, c" in e.value.message

    run(go())


async def long_request(f, name: str, seconds: float) -> tuple[asyncio.Task, asyncio.Event]:
    """A request on `name` that holds its lease for `seconds`, started and holding it when this returns: (its
    task, an event set when it has ended)."""
    held, done = asyncio.Event(), asyncio.Event()

    async def request():
        async with f.use(name):
            held.set()
            await asyncio.sleep(seconds)
        done.set()

    t = asyncio.create_task(request())
    await held.wait()
    return t, done


def test_a_busy_model_is_drained_never_cancelled_and_a_timeout_keeps_it():
    async def go():
        f, log = _fleet(budget_mb=150, drain_s=5.0)
        t, done = await long_request(f, "a", 0.3)
        async with f.use("b") as m:  # waits for a's request to end, then a goes
            assert done.is_set() and m.entry.name == "b"
            assert f.swapping is None
        await t
        assert not f.models["a"].loaded

        f.drain_s = 0.1
        async with f.use("b"):  # b busy for longer than the drain: the request for a is refused, b stays
            with pytest.raises(ModelRefused) as e:
                async with f.use("a"):
                    pass
        assert e.value.status == 503 and e.value.code == "model_swap_timeout" and e.value.retry_after
        assert f.models["b"].loaded and not f.models["b"].leaving

    run(go())


def test_requests_waiting_for_one_model_share_one_load_and_a_leaver_does_not_cancel_it():
    async def go():
        f, log = _fleet(budget_mb=1000)
        seen = []

        async def one():
            async with f.use("b") as m:
                seen.append(m.entry.name)

        gone = asyncio.create_task(asyncio.wait_for(f.acquire(f.catalog.named("b")), 0.001))
        await asyncio.gather(one(), one(), one(), return_exceptions=True)
        with pytest.raises(asyncio.TimeoutError):
            await gone
        assert seen == ["b"] * 3 and log.count(("build", "b")) == 1
        assert f.models["b"].leases == 0

    run(go())


def test_a_model_that_fails_to_load_brings_back_what_its_swap_unloaded():
    async def go():
        f, log = _fleet(budget_mb=150, fail=("b",))
        with pytest.raises(ModelRefused) as e:
            async with f.use("b"):
                pass
        assert e.value.status == 500 and e.value.code == "model_load_failed" and "not a GGUF" in e.value.message
        assert f.models["a"].loaded and "b" not in f.models and f.swapping is None
        assert log[-1] == ("reload", "a")
        n = len(log)
        with pytest.raises(ModelRefused) as e:  # the same file again: refused at once, nothing unloaded for it
            async with f.use("b"):
                pass
        assert e.value.code == "model_load_failed" and "has not changed" in e.value.message and len(log) == n

    run(go())


def test_a_swap_drops_the_models_adapters_one_line_each(caplog):
    async def go():
        f, log = _fleet(budget_mb=150)
        a = f.models["a"].engine
        a.adapters[1] = LoraInfo(id=1, name="style", path="/l/style")
        assert f.resolve("style") == (f.models["a"].entry, 1)  # an adapter's name reaches its base model
        async with f.use("b"):
            pass
        assert a.adapters == {}
        with pytest.raises(ModelRefused):
            f.resolve("style")

    with caplog.at_level(logging.INFO, logger="imp.fleet"):
        run(go())
    assert "[model-swap] dropped LoRA adapter 'style' (id=1, path=/l/style): model swapped" in caplog.text


def test_unload_and_load_by_the_admin_and_the_idle_clock():
    async def go():
        entries = {n: Entry(n, f"/m/{n}.gguf", 100 * MB, idle_unload_s=(0.5 if n == "b" else None)) for n in "abc"}
        f, log = _fleet(budget_mb=1000, entries=entries)
        await f.start()
        with pytest.raises(ModelRefused) as e:
            await f.unload("b")
        assert e.value.status == 409
        await f.load("b")
        await f.load("b")  # a no-op
        assert log.count(("build", "b")) == 1
        await f.unload("a")
        assert not f.models["a"].loaded
        await asyncio.sleep(1.8)  # b's own idle time passed; a has none (the server's is 0)
        assert not f.models["b"].loaded and f.models["b"].stats["idle_unloads"] == 1
        text = (await f.metrics_text()).decode()
        assert 'imp_requests_total{model="a"} 1.0' in text and 'imp_requests_total{model="b"} 1.0' in text
        assert 'imp_model_loaded{model="c"} 0.0' in text and "imp_models_memory_budget_bytes" in text
        await f.stop()

    run(go())


def test_the_engine_host_leases_a_model_per_request_and_a_client_gone_during_the_load_holds_nothing():
    """The process layout's side (imp.engine.host): an Open naming a fleet model waits for it, holds a lease
    until its Close; a Close while the model still loads opens nothing; a name nothing matches is the
    request's Reject."""
    import os

    from imp.engine import wire
    from imp.engine.host import EngineHost
    from imp.engine.port import Submission
    from imp.messages import Reject, SamplingParams

    class Handle:
        def __init__(self, rid):
            self.req_id, self.done, self.queue = rid, False, None

    async def go():
        f, log = _fleet(budget_mb=1000)
        closed = []
        FakeEngine.open = lambda self, sub: Handle(sub.req_id)
        FakeEngine.close = lambda self, h, lora=0: closed.append(h.req_id)
        try:
            host = EngineHost(f.first.engine, "ipc:///nonexistent", fleet=f)
            out = []
            host._send = lambda ident, frames: out.extend(frames)
            host._on(b"p", wire.Hello(0, os.getpid()))
            peer = host.peers[b"p"]
            sub = lambda rid: Submission(req_id=rid, prompt=(1, 2), params=SamplingParams(max_tokens=2))  # noqa: E731
            host._on(b"p", wire.Open(sub("gone"), "b"))
            await asyncio.sleep(0)
            host._on(b"p", wire.Close("gone"))  # its client left while b loads
            host._on(b"p", wire.Open(sub("kept"), "c"))
            host._on(b"p", wire.Open(sub("nope"), "no-such-model"))
            await asyncio.sleep(0.2)
            assert f.models["b"].loaded and f.models["b"].leases == 0 and "gone" not in peer.open
            assert "kept" in peer.open and f.models["c"].leases == 1
            host._on(b"p", wire.Close("kept"))
            assert f.models["c"].leases == 0 and closed == ["kept"]
            host._flush()
            rejects = [r for fr in out if isinstance(fr, wire.Items) for r in fr.items if isinstance(r, Reject)]
            assert [(r.req_id, r.status) for r in rejects] == [("nope", 404)]
            states = [fr for fr in out if isinstance(fr, wire.State)]
            assert states and set(states[-1].models) == {"a", "b", "c"}  # every swap told the API servers
        finally:
            del FakeEngine.open, FakeEngine.close

    run(go())


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

OPS = st.lists(st.tuples(st.sampled_from(["use", "use", "use", "load", "unload", "cancel", "suspend", "resume"]),
                         st.sampled_from("abcd"), st.integers(0, 3)), min_size=1, max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.integers(100, 450), st.sampled_from([0.0, 0.05]))
def test_random_traffic_never_overruns_the_budget_and_leaves_no_lease(ops, budget_mb, drain_s):
    """Requests (held a few ticks), admin loads and unloads, suspends and resumes and clients that give up, all
    at once: the resident models always fit the budget, every lease comes back, every refusal is a
    ModelRefused."""
    sizes = {"a": 100, "b": 150, "c": 200, "d": 500}  # d never fits a budget under 500 MB

    async def go():
        entries = {n: Entry(n, f"/m/{n}.gguf", mb * MB) for n, mb in sizes.items()}
        f, log = _fleet(budget_mb=budget_mb, drain_s=drain_s, entries=entries)
        worst = 0

        def check():
            nonlocal worst
            used = sum(m.footprint.host for m in f.models.values() if m.loaded)
            worst = max(worst, used)
            assert all(m.leases >= 0 for m in f.models.values())

        async def request(name, ticks):
            async with f.use(name):
                check()
                for _ in range(ticks):
                    await asyncio.sleep(0.005)

        tasks = []
        for op, name, ticks in ops:
            if op == "use":
                tasks.append(asyncio.create_task(request(name, ticks)))
            elif op == "load":
                tasks.append(asyncio.create_task(f.load(name)))
            elif op == "unload":
                tasks.append(asyncio.create_task(f.unload(name, 0.01)))
            elif op == "suspend":
                tasks.append(asyncio.create_task(f.suspend(0.01)))
            elif op == "resume":
                tasks.append(asyncio.create_task(f.resume()))
            elif tasks:
                tasks[-1].cancel()  # a client that leaves (while its model loads, or mid-request)
            await asyncio.sleep(0.002 * ticks)
            check()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            assert r is None or isinstance(r, (ModelRefused, asyncio.CancelledError)) or hasattr(r, "entry") or \
                hasattr(r, "suspended"), r
        await asyncio.sleep(0.05)  # swaps whose waiters left run to their end
        check()
        assert worst <= budget_mb * MB  # with the first model (a, 100 MB) resident at boot, every budget >= 100
        assert all(m.leases == 0 and not m.leaving for m in f.models.values())
        assert f.swapping is None and not f._lock.locked()

    run(go())


def test_suspend_releases_every_model_and_nothing_loads_until_resume():
    """POST /admin/suspend with models on demand: the boot model suspends, every other resident one is drained
    (a running request finishes) and released; requests and admin loads are refused until the resume, which
    brings the boot model back; the others load on demand again."""
    async def go():
        f, log = _fleet(budget_mb=250, drain_s=5.0)
        async with f.use("b"):
            pass
        t, done = await long_request(f, "b", 0.2)
        res = await f.suspend(5.0)
        assert done.is_set()  # drained, never cancelled
        await t
        assert res.models_released == ("b",) and res.kv_released and not res.error, res
        assert not any(m.loaded for m in f.models.values())
        assert ("release", "b", "operator") in log and ("suspend", "a") in log
        with pytest.raises(ModelRefused) as e:
            async with f.use("c"):
                pass
        assert (e.value.status, e.value.code) == (503, "suspended")
        with pytest.raises(ModelRefused) as e2:
            await f.load("b")
        assert (e2.value.status, e2.value.code) == (409, "suspended")
        assert ("build", "c") not in log and ("reload", "b") not in log
        assert (await f.suspend(1.0)).suspended  # a second one changes nothing: the resume still brings a back
        await f.resume()
        assert [n for n, m in f.models.items() if m.loaded] == ["a"] and ("resume", "a", True) in log
        async with f.use("b") as m:
            assert m.loaded and ("reload", "b") in log

    run(go())


def test_requests_for_two_models_that_cannot_sit_together_take_turns():
    """Each swap hands its waiters their leases before the next swap plans: requests for two models that never
    fit together take turns (before, each swap evicted the model the one before had just loaded, for ever)."""
    async def go():
        entries = {n: Entry(n, f"/m/{n}.gguf", mb * MB) for n, mb in {"a": 100, "b": 150}.items()}
        f, log = _fleet(budget_mb=150, drain_s=5.0, entries=entries)

        async def request(name):
            async with f.use(name):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(asyncio.gather(*(request(n) for n in "babab")), 10)
        assert all(m.leases == 0 for m in f.models.values())
        assert sum(e[0] in ("build", "reload") for e in log) <= 5, log

    run(go())


def test_a_resume_that_runs_before_an_announced_suspend_brings_nothing_back_over_the_budget():
    """hypothesis found it: a request swaps the boot model (a) out for b, a resume and then a suspend arrive while
    the swap runs. The resume takes the lock first, when nothing is parked yet: it is a no-op (it used to read the
    suspend's announcement as a suspend and bring a back beside b, 250 MB in a 150 MB budget)."""
    sizes = {"a": 100, "b": 150}

    async def go():
        entries = {n: Entry(n, f"/m/{n}.gguf", mb * MB) for n, mb in sizes.items()}
        f, log = _fleet(budget_mb=150, drain_s=0.0, entries=entries)
        worst = 0

        def used():
            nonlocal worst
            worst = max(worst, sum(m.footprint.host for m in f.models.values() if m.loaded))

        async def request(name):
            async with f.use(name):
                used()

        tasks = [asyncio.create_task(request("b")), asyncio.create_task(f.resume())]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(f.suspend(0.01)))
        res = await asyncio.gather(*tasks, return_exceptions=True)
        used()
        assert worst <= 150 * MB, log
        assert isinstance(res[1], ResumeResult) and not res[1].reloaded  # nothing was parked when it ran
        assert res[2].suspended and res[2].models_released == ("b",)
        assert f.suspended and not any(m.loaded for m in f.models.values())
        back = await f.resume()  # the suspend's resume: the boot model was not resident when it came
        assert not back.reloaded and not f.suspended

    run(go())
