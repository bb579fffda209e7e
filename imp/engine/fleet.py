"""Models on demand: every model of the catalog served by name, resident within a memory budget.

Each model that has been loaded keeps its own engine (imp.engine.local: scheduler, KV pool, executor,
metrics and event-log stream); the fleet decides which of them hold their weights now. A request
naming a model that is not resident waits here (its timeout applies) while the fleet plans the
load with the pure core (imp.core.residency), unloads what must go (drained, never cancelled; a
drain that times out is a 503 and the victim stays), then loads it: the first time by building
its engine, after that by reloading the engine's released weights. /ready says `swapping`
meanwhile. An unloaded model drops its LoRA adapters, one log line each, as the API reference says.

The boot model's engine is the home of what outlives a swap (the Responses store); its weights are
swapped like any other model's.

Every model's request holds a lease (`use`) from before its prompt is rendered to its last byte:
what a drain waits for, and what keeps a model from being unloaded under a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import msgspec

from imp.core.residency import Budget, Footprint, Resident, idle_victims, plan_load
from imp.engine.catalog import Catalog, Entry
from imp.engine.port import ModelRefused, ResumeResult, SuspendResult

log = logging.getLogger("imp.fleet")


@dataclass
class Model:
    """A model whose engine exists: resident (its weights loaded) or released."""

    entry: Entry
    engine: object  # imp.engine.local.LocalEngine
    text: object  # imp.text.model.TextModel
    grammars: object  # imp.constrain.compile.GrammarCache
    footprint: Footprint  # the budget's figure: the estimate, or what an unload freed where that was more
    loaded: bool = True
    measured: bool = False  # an unload has been measured
    leaving: bool = False  # being drained for an unload: new requests wait for the swap to end
    leases: int = 0
    last_used: float = 0.0
    loads: int = 1
    load_seconds: float = 0.0  # the last load's (build or reload)
    stats: dict = field(default_factory=lambda: {"swaps_in": 0, "swaps_out": 0, "idle_unloads": 0})


# (entry) -> (engine, text model, grammar cache): builds a model's engine (reads its file) and starts it; the
# boot's own code (imp.server)
Build = Callable[[Entry], Awaitable[tuple]]


def measured(states: list, on_gpu: bool) -> Footprint | None:
    """What an unload freed, from the executors' MemoryStates (rss and the card's free bytes before and
    after); None when nothing was measured."""
    if not states:
        return None
    host = sum(abs(m.rss_after - m.rss_before) for m in states)
    dev = sum(abs(m.device_free_before - m.device_free_after) for m in states) if on_gpu else 0
    return Footprint(dev, host) if (host or dev) else None


class Fleet:
    def __init__(self, catalog: Catalog, budget: Budget, build: Build, first: Entry, parts: tuple, *,
                 on_gpu: bool, drain_s: float = 30.0, idle_s: float = 0.0, kv_tokens: int = 16384,
                 clock=time.monotonic):
        """first: the boot model's entry, parts its (engine, text, grammars), built and started; drain_s: how
        long an unload waits for a model's requests; idle_s: the server's --idle-unload-seconds (a models-file
        entry may set its own); kv_tokens: each model's KV pool, for the estimate before a model's first unload."""
        self.catalog = catalog.with_entry(first)
        self.budget, self.build, self.on_gpu = budget, build, on_gpu
        self.drain_s, self.idle_s, self.kv_tokens, self.clock = drain_s, idle_s, kv_tokens, clock
        self.models: dict[str, Model] = {}
        self.first = self.models[first.name] = Model(first, *parts, self.need(first), last_used=clock())
        self.swapping: str | None = None  # the model being loaded now (/ready: swapping)
        self._lock = asyncio.Lock()
        self._pending: dict[str, asyncio.Future] = {}  # name -> the swap bringing it in
        self._tickets: dict[str, list[list]] = {}  # name -> its waiters' tickets: the swap puts a leased Model in each
        self.failed: dict[str, tuple[float, str]] = {}  # name -> (its file's mtime, why) of a load that failed
        self._idle_task: asyncio.Task | None = None
        self.swap_seconds: list[float] = []  # every load's seconds (build or reload), for /metrics
        self.on_change = None  # () -> None after a model loads or unloads (the engine host tells the API servers)
        self.suspended = False  # POST /admin/suspend: nothing loads until /admin/resume (set as a suspend arrives)
        self._parked = False  # a suspend has run (under the lock) and no resume since
        self._boot_resident = True  # the boot model was resident when the suspend came

    # ------------------------------------------------------------------ names

    def resolve(self, name: str) -> tuple[Entry, int | None]:
        """The catalog entry a request's `model` names, and the LoRA adapter id when it names an adapter of
        a model whose engine has it; ModelRefused 404 model_not_found when nothing matches."""
        for m in self.models.values():
            if m.loaded:
                lid = m.engine.lora_named(name)
                if lid is not None:
                    return m.entry, lid
        entry = self.catalog.resolve(name)
        if entry is None:
            known = ", ".join(e.name for e in self.catalog.entries)
            raise ModelRefused(404, "model_not_found",
                               f"model '{name[:128]}' not found (models: {known}; GET /v1/models lists them)")
        return entry, None

    # ------------------------------------------------------------------ leases

    @contextlib.asynccontextmanager
    async def use(self, name: str, timeout_s: float = 0.0):
        """The resident Model a request named, loaded first if need be; held until the block ends."""
        entry, _ = self.resolve(name)
        m = await (asyncio.wait_for(self.acquire(entry), timeout_s) if timeout_s > 0 else self.acquire(entry))
        try:
            yield m
        finally:
            self.release(m)

    def release(self, m: Model) -> None:
        """A lease from `acquire` ends."""
        m.leases -= 1
        m.last_used = self.clock()

    async def acquire(self, entry: Entry) -> Model:
        while True:
            self._refuse_if_suspended(503)
            m = self.models.get(entry.name)
            if m is not None and m.loaded and not m.leaving:
                m.leases += 1  # no await between the check and this: a swap cannot slip in
                m.last_used = self.clock()
                return m
            # the swap hands this waiter its lease before it lets the next swap plan: were the lease taken only
            # when the waiter wakes, the next swap (another model that cannot sit beside this one) could evict
            # it first, and two such models' requests would swap each other out for ever
            ticket: list[Model] = []
            waiting = self._tickets.setdefault(entry.name, [])
            waiting.append(ticket)
            try:
                # shielded: a request that times out or whose client leaves stops waiting, the swap goes on
                await asyncio.shield(self._swap_to(entry))
            except BaseException:
                if ticket:  # handed a lease, but gone before it woke (its client left, its timeout)
                    self.release(ticket[0])
                raise
            finally:
                waiting[:] = [t for t in waiting if t is not ticket]  # by identity: empty tickets are all equal
            if ticket:
                return ticket[0]

    def _swap_to(self, entry: Entry) -> asyncio.Future:
        """The one swap that makes entry resident (every waiter for it shares it); one swap at a time runs,
        under the lock, so a request for a model being drained waits here too. Its waiters get their leases
        inside it (acquire)."""
        t = self._pending.get(entry.name)
        if t is None or t.done():
            async def swap():
                async with self._lock:
                    m = self.models.get(entry.name)
                    if m is None or not m.loaded:
                        await self._bring(entry)
                    m = self.models[entry.name]
                    for ticket in self._tickets.get(entry.name, []):
                        if not ticket and m.loaded and not self.suspended:
                            ticket.append(m)
                            m.leases += 1
                            m.last_used = self.clock()

            t = self._pending[entry.name] = asyncio.ensure_future(swap())
            t.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: no "never retrieved" warning
        return t

    # ------------------------------------------------------------------ load / unload

    def need(self, entry: Entry) -> Footprint:
        """What loading entry will take: the estimate (weights on disk + the KV pool at 2 bytes an element, on
        the device where a GPU runs it), or what its unloads freed where that was more. The budget counts what
        an unload can give back: a model's text side and grammar vocabulary stay with its engine."""
        m = self.models.get(entry.name)
        if m is not None:
            return m.footprint
        return self.estimate(entry)

    def estimate(self, entry: Entry) -> Footprint:
        est = entry.size_bytes + self.kv_tokens * entry.kv_bytes_per_token
        return Footprint(est, 0) if self.on_gpu else Footprint(0, est)

    def residents(self) -> list[Resident]:
        return [Resident(m.entry.name, m.footprint, m.last_used, busy=m.leases > 0,
                         idle_unload_s=self.idle_of(m.entry))
                for m in self.models.values() if m.loaded]

    def idle_of(self, entry: Entry) -> float:
        return self.idle_s if entry.idle_unload_s is None else entry.idle_unload_s

    def _refuse_if_suspended(self, status: int) -> None:
        if self.suspended:
            raise ModelRefused(status, "suspended", "the server is suspended: no model is served or loaded until "
                                                    "POST /admin/resume")

    async def _bring(self, entry: Entry) -> None:
        """Under the lock: unload what the plan says, then load entry (a failed load reloads what went)."""
        self._refuse_if_suspended(503)  # a swap queued before the suspend
        failed = self.failed.get(entry.name)
        if failed is not None and failed[0] == _mtime(entry.path):  # the same file failed before: evict nothing
            raise ModelRefused(500, "model_load_failed", f"model {entry.name!r} failed to load: {failed[1]} "
                                                         "(the file has not changed since)")
        plan = plan_load(entry.name, self.need(entry), self.residents(), self.budget)
        if not plan.fits:
            raise ModelRefused(400, "model_too_large", plan.why)
        self.swapping = entry.name
        gone: list[str] = []
        try:
            for name in plan.evict:
                await self._unload(self.models[name], "model-swap", self.drain_s)
                gone.append(name)
            await self._load(entry)
        except ModelRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - a file that does not load: the caller's answer, the rest restored
            log.warning("[model-swap] loading %s failed: %s: %s", entry.name, type(exc).__name__, exc)
            self.failed[entry.name] = (_mtime(entry.path), f"{type(exc).__name__}: {exc}")
            for name in gone:  # what this swap unloaded comes back (its adapters do not: the reference says so)
                try:
                    await self._load(self.models[name].entry)
                except Exception as again:  # noqa: BLE001
                    log.warning("[model-swap] restoring %s failed too: %s", name, again)
            raise ModelRefused(500, "model_load_failed", f"model {entry.name!r} failed to load: "
                                                         f"{type(exc).__name__}: {exc}") from None
        finally:
            self.swapping = None

    async def _load(self, entry: Entry) -> Model:
        t0 = time.monotonic()
        m = self.models.get(entry.name)
        if m is None:
            need = self.need(entry)
            m = self.models[entry.name] = Model(entry, *await self.build(entry), need)
        else:
            states = await m.engine.reload()
            errors = [s.error for s in states if s.error]
            if errors or m.engine.fault:
                raise RuntimeError("; ".join(errors) or m.engine.fault)
            m.loaded, m.loads = True, m.loads + 1
        m.load_seconds = time.monotonic() - t0
        m.last_used = self.clock()
        m.stats["swaps_in"] += 1
        self.swap_seconds.append(m.load_seconds)
        log.info("[model-swap] %s loaded in %.2fs (%s)", entry.name, m.load_seconds, _bytes(m.footprint))
        self._changed()
        return m

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _unload(self, m: Model, reason: str, drain_s: float) -> None:
        """Drain m's requests (never cancelled) for up to drain_s, drop its adapters, release its weights."""
        m.leaving = True
        try:
            deadline = time.monotonic() + drain_s
            while m.leases and time.monotonic() < deadline and not m.engine.fault:
                await asyncio.sleep(0.02)
            if m.leases:
                raise ModelRefused(503, "model_swap_timeout",
                                   f"model {m.entry.name!r} still runs {m.leases} requests after {drain_s:g}s; "
                                   "it stays loaded. Retry later", retry_after=max(1.0, drain_s / 4))
            for a in m.engine.loras():  # a swap drops every adapter (API reference: Admin, LoRA)
                await m.engine.lora_unload(a.id, None, drain_s=0.0)
                log.info("[model-swap] dropped LoRA adapter '%s' (id=%d, path=%s): model swapped", a.name, a.id, a.path)
            states = await m.engine.release(reason)
            errors = [s.error for s in states if s.error]
            if errors:
                raise ModelRefused(500, "model_unload_failed", f"model {m.entry.name!r}: {'; '.join(errors)}")
            m.loaded = False
            m.stats["idle_unloads" if reason == "idle" else "swaps_out"] += 1
            freed = measured(states, self.on_gpu)
            if freed is not None:  # what it gave back, if more than the estimate (never less: a CPU's weights
                # are file pages, partly untouched when it goes, all touched by a long prompt)
                m.footprint = Footprint(max(freed.device, m.footprint.device), max(freed.host, m.footprint.host))
                m.measured = True
            log.info("[model-swap] %s unloaded (%s): %s freed", m.entry.name, reason, _bytes(freed) if freed else "?")
            self._changed()
        finally:
            m.leaving = False

    async def load(self, name: str, for_request: bool = False) -> Model:
        """POST /admin/models/load: name resident (a no-op when it is). for_request: an API server's request
        waits for it (the process layout's model_use): refused as a request is while suspended (503, not 409)."""
        entry, _ = self.resolve(name)
        self._refuse_if_suspended(503 if for_request else 409)
        await asyncio.shield(self._swap_to(entry))
        m = self.models[entry.name]
        m.last_used = self.clock()
        return m

    async def unload(self, name: str, drain_s: float | None = None) -> Model:
        """POST /admin/models/unload: its requests drained, its weights released (404 if unknown, 409 if not loaded)."""
        entry, _ = self.resolve(name)

        async def unload():
            async with self._lock:
                m = self.models.get(entry.name)
                if m is None or not m.loaded:
                    raise ModelRefused(409, "model_not_loaded", f"model {entry.name!r} is not loaded")
                await self._unload(m, "operator", self.drain_s if drain_s is None else drain_s)
                return m

        return await asyncio.shield(asyncio.ensure_future(unload()))  # a client that leaves does not cut it

    async def suspend(self, drain_s: float) -> SuspendResult:
        """(below) Shielded: a client that leaves does not cut a suspend half way."""
        return await asyncio.shield(asyncio.ensure_future(self._suspend(drain_s)))

    async def resume(self) -> ResumeResult:
        return await asyncio.shield(asyncio.ensure_future(self._resume()))

    async def _suspend(self, drain_s: float) -> SuspendResult:
        """POST /admin/suspend with models on demand: the card (or RAM) given back by every model, not the boot
        model's alone. From now on nothing is served or loaded (503 / 409 `suspended`); the boot model suspends
        as a single server does (its admission closed at once, sticky), while every other resident model is
        drained (never cancelled) and released beside it. The boot model's result (its memory figures), the
        others' names in models_released; a drain that timed out keeps that model (error)."""
        self.suspended = True  # refused from now on, while the swap under way ends
        async with self._lock:  # after a swap under way: what it brought in is then released too
            # (set again: a resume that arrived before this suspend, and held the lock first, cleared it)
            self.suspended, first_time, self._parked = True, not self._parked, True
            if first_time:  # what the resume brings back (a second suspend finds it released already)
                self._boot_resident = self.first.loaded
            boot = asyncio.ensure_future(self.first.engine.suspend(drain_s))  # beside the others' drains
            released, errors = [], []
            for m in [m for m in self.models.values() if m.loaded and m is not self.first]:
                try:
                    await self._unload(m, "operator", drain_s)
                    released.append(m.entry.name)
                except ModelRefused as exc:
                    errors.append(exc.message)
            res = await boot
            if res.kv_released and self.first.loaded:  # the boot model's weights went with its suspend
                self.first.loaded = False
                self._changed()
        # the memory figures stay the boot model's (the others' releases ran beside it: a sum would count twice);
        # /v1/models shows what each holds now
        return msgspec.structs.replace(res, models_released=tuple(released), kv_released=res.kv_released and not errors,
                                       error="; ".join(x for x in (res.error, *errors) if x))

    async def _resume(self) -> ResumeResult:
        """POST /admin/resume: the boot model loaded again if it was resident when the suspend came (a model
        whose drain timed out stayed beside it: they fit), then admitted; the others load on demand as before."""
        async with self._lock:  # after the suspend (or swap) under way: a swap must never plan around it
            # nothing parked when it runs: a no-op, even where a suspend that arrived after it is announced (its
            # `suspended`) but waits for the lock; bringing the boot model back then (as `_boot_resident` from an
            # older suspend said) put it beside the model a swap had just loaded in its place, over the budget
            if not self._parked:
                return await self.first.engine.resume(reload=self.first.loaded)
            back = self._boot_resident
            res = await self.first.engine.resume(reload=back)
            self.suspended = self._parked = False
            if back and not self.first.loaded and not self.first.engine.fault:
                self.first.loaded, self.first.last_used = True, self.clock()
                self._changed()
            return res

    # ------------------------------------------------------------------ what HTTP reads (imp.engine.port.Models)

    @property
    def default(self) -> str:
        return self.first.entry.name

    @contextlib.asynccontextmanager
    async def serve(self, name: str, timeout_s: float = 0.0, load: bool = True):
        """(port, text model, grammars) of the model name names, resident for the block (a lease). load=False
        (an estimate, which never loads a model): ModelRefused 409 model_not_loaded when it is not resident."""
        if not load:
            self.resident_now(name)
        async with self.use(name, timeout_s) as m:
            yield m.engine, m.text, m.grammars

    def resident_now(self, name: str) -> Model:
        entry, _ = self.resolve(name)
        m = self.models.get(entry.name)
        if m is None or not m.loaded or m.leaving:
            raise ModelRefused(409, "model_not_loaded", f"model {entry.name!r} is not loaded")
        return m

    def row(self, e: Entry) -> dict:
        """One model's /v1/models row: resident or not, its bytes and its context figures."""
        m = self.models.get(e.name)  # None: never loaded
        loaded = m is not None and m.loaded
        row = {"id": e.name, "object": "model", "created": e.created, "owned_by": "imp", "loaded": loaded,
               "size_bytes": e.size_bytes, "context_length": e.context_length,
               "max_context_at_width_1": None}  # the capacity reference: null until its pool exists
        if e.aliases:
            row["aliases"] = list(e.aliases)
        if m is not None:
            card = m.engine.card
            row.update(context_length=card.context_length, loads=m.loads, last_load_seconds=round(m.load_seconds, 3))
            if loaded:  # its KV pool exists now
                row.update(max_context_at_width_1=min(card.context_length, card.kv_blocks * card.block_size),
                           kv_capacity_tokens=card.kv_blocks * card.block_size * card.replicas)
        fp = m.footprint if loaded else Footprint()
        row.update(resident_bytes=fp.device + fp.host, resident_device_bytes=fp.device, resident_host_bytes=fp.host)
        if self.swapping == e.name:
            row["loading"] = True
        return row

    async def rows(self) -> list[dict]:
        """Every model of the catalogue, then the resident models' LoRA adapters (`parent`: their base)."""
        out = [self.row(e) for e in self.catalog.entries]
        for m in self.models.values():
            if m.loaded:
                out += [{"id": a.name, "object": "model", "created": m.engine.card.created, "owned_by": "imp",
                         "parent": m.entry.name, "root": a.path, "lora_id": a.id} for a in m.engine.loras()]
        return out

    async def status(self) -> dict:
        return {"swapping": self.swapping, "loaded": [n for n, m in self.models.items() if m.loaded]}

    async def resident(self) -> list[dict]:
        """/v1/metrics' resident_models: a row per resident model."""
        out = []
        for m in self.models.values():
            if m.loaded:
                card, snap = m.engine.card, await m.engine.snapshot()
                out.append({"model": m.entry.name, "kind": "chat", "in_flight": snap.queue.running,
                            "waiting": snap.queue.waiting, "resident_device_bytes": m.footprint.device,
                            "resident_host_bytes": m.footprint.host, "context_length": card.context_length,
                            "kv_capacity_tokens": card.kv_blocks * card.block_size, "kv_blocks_free": snap.kv.free,
                            "kv_blocks_total": snap.kv.total})
        return out

    def ports(self) -> list:
        """The resident models' engines (LoRA admin: each numbers its own adapters)."""
        return [m.engine for m in self.models.values() if m.loaded]

    async def load_row(self, name: str) -> dict:
        m = await self.load(name)
        return {**self.row(m.entry), "loaded": True}

    async def unload_row(self, name: str, drain_s: float | None = None) -> dict:
        m = await self.unload(name, drain_s)
        return {**self.row(m.entry), "unloaded": True}

    # ------------------------------------------------------------------ idle unload, lifecycle

    async def start(self) -> None:
        if self.idle_s > 0 or any(e.idle_unload_s for e in self.catalog.entries):
            self._idle_task = asyncio.create_task(self._idle_loop(), name="fleet-idle-unload")

    async def stop(self) -> None:
        """The models other than the boot one (the app stops that one)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
        for m in list(self.models.values()):
            if m is not self.first:
                await m.engine.stop()

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._lock.locked():
                continue
            for name in idle_victims(self.clock(), self.residents()):
                async with self._lock:
                    m = self.models[name]
                    if m.loaded and not m.leases:
                        try:
                            await self._unload(m, "idle", 0.0)
                        except ModelRefused as exc:
                            log.warning("[idle-unload] %s: %s", name, exc.message)

    async def metrics_text(self) -> bytes:
        """Every model's metrics in one exposition, each sample labelled with its model (imp.engine.exposition),
        and the fleet's own: resident bytes, loads and unloads, the budget; imp_model_loaded 0 for a model of
        the catalog never loaded."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

        from imp.engine.exposition import merge

        reg = CollectorRegistry()
        loaded = Gauge("imp_model_loaded", "1 while the model is loaded", ["model"], registry=reg)
        resident = Gauge("imp_model_resident_bytes", "bytes the model holds while resident (0 unloaded), "
                         "measured at its last load", ["model", "memory"], registry=reg)
        swaps = Counter("imp_model_swaps", "model loads (in) and unloads for another model (out)",
                        ["model", "direction"], registry=reg)
        idle = Counter("imp_model_idle_unloads", "unloads after the model's idle-unload time", ["model"], registry=reg)
        last = Gauge("imp_model_load_seconds_last", "seconds the model's last load took", ["model"], registry=reg)
        budget = Gauge("imp_models_memory_budget_bytes", "--models-memory (0: no limit)", ["memory"], registry=reg)
        budget.labels("device").set(self.budget.device)
        budget.labels("host").set(self.budget.host)
        Gauge("imp_models_swapping", "1 while a model loads or swaps (/ready: swapping)", registry=reg).set(
            1 if self.swapping else 0)
        for e in self.catalog.entries:
            m = self.models.get(e.name)
            if m is None:
                loaded.labels(e.name).set(0)
                continue
            fp = m.footprint if m.loaded else Footprint()
            resident.labels(e.name, "device").set(fp.device)
            resident.labels(e.name, "host").set(fp.host)
            swaps.labels(e.name, "in").inc(m.stats["swaps_in"])
            swaps.labels(e.name, "out").inc(m.stats["swaps_out"])
            idle.labels(e.name).inc(m.stats["idle_unloads"])
            last.labels(e.name).set(m.load_seconds)
        parts = [(name, await m.engine.metrics_text()) for name, m in self.models.items()]
        return merge([*parts, ("", generate_latest(reg))])

    async def drain(self, timeout_s: float) -> int:
        """SIGTERM: every model's admitted requests finish (up to timeout_s); how many were left."""
        left = await asyncio.gather(*(m.engine.drain(timeout_s) for m in self.models.values()))
        return sum(left)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0


def _bytes(f: Footprint) -> str:
    parts = [f"{f.device / 2**20:.0f} MiB device"] if f.device else []
    return ", ".join(parts + [f"{f.host / 2**20:.0f} MiB host"])
