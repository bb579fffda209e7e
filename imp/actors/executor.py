"""Executor actor: runs one model step per StepPlan, in plan order.

The model runs on worker threads so the event loop keeps serving HTTP while
a step computes (torch releases the GIL inside its kernels). The executor
reads the clock (it is a shell, not a core): the time it puts into
StepResult is how time reaches the scheduler, and the log records it.

Two ways to run a step:
  sync (CPU ModelRunner): `runner.step(seqs)` on one thread. With a
      pipelining scheduler a plan can feed PENDING_TOKEN; by the time it runs
      here the previous step has finished, so the token is filled in on the
      host from that step's samples (`imp.sampling.pending`).
  launch/collect (GpuModelRunner): `runner.launch(seqs)` enqueues the step on
      the device and returns at once; a second thread waits for it with
      `runner.collect(handle)` and sends the StepResult. So step N+1 is
      launched while the GPU still runs step N (the scheduler planned it
      meanwhile), and PENDING_TOKEN is read on the device from step N's
      samples without a round trip to the host.
Results go back strictly in plan order; a launch that raises becomes a
StepFailed in its turn, unless it is a device fault (`imp.actors.faults`): then the
executor stops and reports a Fault, which ends every request.

Suspend: an `Unload` drops the runner (its weights and KV pool) and hands the memory
back; the next StepPlan, or a `Reload`, builds it again with `loader` (the boot's own
load call), so an idle-unloaded server resumes inside the request that wakes it. Each
answers ingress with a `MemoryState` carrying the bytes it measured. A sequence's SamplingParams (and a penalized one's generated tokens) come with its
first share after each admission only; `attach_state` keeps them (until the plan that
frees the sequence), appends what this executor samples, and hands the runners
complete SeqWorks. A plan's decode lane rows come as columns (`StepPlan.rows`): a runner with
`takes_rows` (the GPU's) gets them so (`imp.sampling.works.Works`) and lands ids (`collect_ids`),
another gets them as SeqWorks; either way their ids go back as one column (`landed_result`).
"""

from __future__ import annotations

import asyncio
import os
import concurrent.futures
import contextlib
import logging
import sys
import time

import msgspec

from imp.actors.base import Actor, Bus
from imp.actors.channel import Channel
from imp.actors.faults import FaultPlan, is_device_fault
from imp.actors import memory
from imp.messages import (KvDrop, KvLoad, KvLoaded, KvSave, KvSwapIn, KvSwapOut, LoraLoad, LoraState, LoraUnload, MemoryState, Msg, Reload,
                          SampledToken, SamplingParams, SeqWork, StepFailed, StepPlan, StepResult, Unload)
from imp.sampling.pending import resolve_pending
from imp.sampling.works import HistoryView, RowBatch, Works, split_tokens

log = logging.getLogger("imp.executor")



def _inference_mode():
    """torch's inference mode around a step where the process has torch (the GPU runner, the
    torch CPU forwards); the fused CPU forward runs without torch. (imp.model.team does the
    same for its thread; actors do not import imp.model.)"""
    torch = sys.modules.get("torch")
    return torch.inference_mode() if torch is not None else contextlib.nullcontext()

def attach_state(plan: StepPlan, kept: dict[str, SamplingParams], hists: dict[str, list[int]]) -> list[SeqWork]:
    """Forget the plan's freed sequences, keep the params (and, for penalized or constrained ones, the
    generated-token history) a first share brings, and return the shares complete: params filled in, and a
    sampled share's history (when the scheduler sent none: `SchedulerConfig.history_once`) cut from the kept
    one to `gen_index - pending` tokens (this executor may already hold the tokens still in flight for the
    scheduler: they must not count twice). A share without params for a sequence never seen, or needing more
    history than was kept, is the scheduler's bug: KeyError."""
    for sid in plan.freed:
        kept.pop(sid, None)
        hists.pop(sid, None)
    out, replace = [], msgspec.structs.replace
    for w in plan.seqs:  # (a batch-256 step's rows: one struct copy a row at most, one needs_history)
        p = w.params
        if p is None:
            p = kept[w.seq_id]
            hist = w.seq_id in hists  # (kept from its first share iff its params need the history)
        else:
            kept[w.seq_id] = p
            hist = p.needs_history
            if hist:
                hists[w.seq_id] = list(w.history)
        n = w.gen_index - w.pending
        if hist and w.sample and not w.history and n > 0:
            h = hists[w.seq_id]
            if len(h) < n:
                raise KeyError(f"{w.seq_id}: {n} tokens of history needed, {len(h)} kept")
            w = replace(w, params=p, history=HistoryView(h, n))
        elif w.params is None:
            w = replace(w, params=p)
        out.append(w)
    return out


def plan_works(plan: StepPlan, kept: dict[str, SamplingParams], hists: dict[str, list[int]]) -> list[SeqWork]:
    """Every share of the plan complete, its decode rows first as SeqWorks (`attach_state` + `RowBatch.works`): what
    a runner without `takes_rows` is handed."""
    general = attach_state(plan, kept, hists)
    return RowBatch(plan.rows, kept, hists).works() + general if plan.rows is not None and len(plan.rows) else general


def landed_result(step: int, tokens: list[SampledToken], rows: RowBatch | None, hists: dict[str, list[int]], now: int,
                  elapsed: int, dev: int = 0, landed=None) -> StepResult:
    """A landed step's StepResult, its samples appended to the kept histories: the decode rows' ids as a column,
    the general shares' tokens. landed: (seq_ids, ids) as a `takes_rows` runner landed them (`collect_ids`), else
    the step's tokens are all in `tokens`."""
    if rows is None:
        record_samples(tokens, hists)
        return StepResult(step, tuple(tokens), now, elapsed, dev)
    if landed is not None:
        ids, tokens = split_tokens(rows.seq_ids, landed[0], landed[1], None)
    else:
        ids, tokens = split_tokens(rows.seq_ids, None, None, tokens)
    record_samples(tokens, hists)
    if hists:
        for sid, t in zip(rows.seq_ids, ids.tolist()):
            h = hists.get(sid)
            if h is not None and t >= 0:
                h.append(t)
    return StepResult(step, tuple(tokens), now, elapsed, dev, ids.astype("<i8").tobytes())


def record_samples(tokens, hists: dict[str, list[int]]) -> None:
    """Append a step's sampled tokens (a verify's kept drafts first) to the histories kept for their sequences."""
    if not hists:
        return
    for t in tokens:
        h = hists.get(t.seq_id)
        if h is not None:
            if t.accepted:
                h.extend(a.token_id for a in t.accepted)
            h.append(t.token_id)


def _fetch(tier, runner, key: bytes):
    """A tier read thread's share of a load: the block's bytes, read where the runner wants them (a GPU: into a
    pinned staging buffer, so the step thread only queues the DMA)."""
    staging = getattr(runner, "kv_staging", None)
    if staging is None:
        return tier.fetch(key, runner.kv_block_bytes())
    buf = staging()
    data, source = tier.fetch(key, runner.kv_block_bytes(), into=buf.numpy())
    if data is None:
        runner.kv_unstage(buf)
        return None, ""
    return buf, source


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _fetch_fill(tier, runner, key: bytes, block: int):
    """A read thread's whole load for a runner whose block copies may be queued from any thread (the GPU's
    DMAs go on the step stream; the block is the allocator's until KvLoaded, so no step touches it meanwhile):
    ((filled, source), seconds reading, seconds queuing the copy). One hop of the event loop a block, not two
    (a restart's 1,249 blocks left the step thread 0.4-0.7 s of copies to queue behind the loop's callbacks)."""
    t0 = time.perf_counter()
    data, source = _fetch(tier, runner, key)
    t1 = time.perf_counter()
    if data is not None:
        runner.set_kv_block(block, data)
    return (data is not None, source), t1 - t0, time.perf_counter() - t1


def _fetch_fill_chunk(tier, runner, items: list[tuple[bytes, int]]):
    """A read thread's chunk of loads (runners with `kv_chunk_blocks`): every file read into its slot of one
    pinned chunk, then the chunk placed at once (`set_kv_blocks`: one copy up, one launch on a GPU).
    ([(filled, source)] in items' order, seconds reading, seconds queuing the copies)."""
    t0 = time.perf_counter()
    chunk = runner.kv_chunk_staging()
    n = runner.kv_block_bytes()
    try:
        where = tier.fetch_many([key for key, _ in items], n, chunk[0].numpy())
    except BaseException:
        runner.kv_chunk_unstage(chunk)  # the ring keeps its buffer
        raise
    out = [(bool(w), w) for w in where]
    placed = [(i, block) for i, (_, block) in enumerate(items) if where[i]]
    t1 = time.perf_counter()
    runner.set_kv_blocks(chunk, placed)  # gives the chunk back to its ring (behind its copies)
    return out, t1 - t0, time.perf_counter() - t1


class _Burst:
    """Loads in flight together (a restart reading a long prompt back): their count and where the time went."""

    def __init__(self, t0: float):
        self.t0, self.flying, self.blocks, self.read_s, self.set_s, self.done = t0, 0, 0, 0.0, 0.0, False


# the tiers' reads side by side (a file read and its digest let go of the GIL); on the GPU machine's 16 cores 8
# threads read 2.6 GB back in 0.42 s with nothing else to do (bench/prompt_cache.py --null-kv-bytes)
READ_THREADS = min(16, max(4, os.cpu_count() or 4))


class ExecutorActor(Actor):
    name = "executor"

    def __init__(self, bus: Bus, runner, name: str = "executor", scheduler: str = "scheduler",
                 constraints=None, faults: FaultPlan | None = None, loader=None, loras=None, lora_reader=None,
                 tier=None, kv: str = "kv"):
        """constraints: an imp.constrain.book.ConstraintBook (grammar masks for constrained
        sequences), handed to the runner with every step; None = no grammar engine.
        faults: the boot-time fault-injection plan (tests), or None.
        loader: () -> a runner like `runner`, for loading it again after an Unload (None: this
        executor cannot unload; an Unload is answered with an error).
        loras: the replica's adapter table (imp.model.lora.LoraTable, injected at boot: it
        outlives the runner across an Unload); lora_reader: (path, model config) -> a checked
        adapter, raising ValueError with the reason (None: no LoRA).
        tier: the prefix cache's disk tier (imp.actors.kvtier.KvTier; None: none), whose KvSave / KvLoad /
        KvDrop come from `kv` (its replica's allocator) in order with the steps."""
        self.name = name
        self.tier, self.kv = tier, kv
        self._io = None  # the tier's file thread (one: its writes and deletes stay in order)
        self._reads = None  # the tier's read threads (loads side by side: a restart reads a long prompt back)
        self._loading: set[asyncio.Task] = set()
        self._burst: _Burst | None = None  # the loads in flight now, timed for one log line
        self._chunking: list = []  # KvLoads taken since the last flush (runners that load a chunk at a time)
        super().__init__(bus)
        self.scheduler = scheduler  # its replica's scheduler (data parallel: "scheduler.i")
        self.runner = runner
        self.loader = loader
        self.device = getattr(runner, "device", None)
        self.fingerprint = getattr(runner, "fingerprint", "")
        self.book = constraints
        self.pipelined = hasattr(runner, "launch") and hasattr(runner, "collect")
        # a runner that reads a plan's decode rows as columns (`imp.sampling.works.Works`) and lands ids
        # (`collect_ids`); another gets them as SeqWorks
        self.takes_rows = bool(getattr(runner, "takes_rows", False))
        # one launch thread: torch's per-thread state (threads, grad mode, device) stays put; a
        # runner that has its own step thread (the CPU runner's OpenMP team) lends it instead
        lent = getattr(runner, "step_pool", None)
        self._own_pool = lent is None
        self._pool = lent or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-wait")
        self._landing: Channel | None = None
        self._collector: asyncio.Task | None = None
        self._last: dict[str, int] = {}  # sync path: what the previous step sampled
        self._params: dict[str, SamplingParams] = {}  # by sequence, from its first share
        self._hists: dict[str, list[int]] = {}  # generated tokens of penalized / constrained sequences
        self.steps = 0
        self.loras = loras
        self.lora_reader = lora_reader
        self.faults = faults
        self._planned = 0  # steps started (the injection hook counts these)

    def _run_step(self, seqs: list[SeqWork], rows: RowBatch | None = None) -> list[SampledToken]:
        if rows is not None:  # (a runner without `takes_rows`: the rows as SeqWorks, first)
            seqs = rows.works() + seqs
        seqs = resolve_pending(seqs, self._last) if any(w.pending for w in seqs) else seqs
        with _inference_mode():
            tokens = self.runner.step(seqs, constraints=self.book, lora=self.loras) if seqs else []
        self._last = {t.seq_id: t.token_id for t in tokens}
        return tokens

    def _launch(self, seqs: list[SeqWork], rows: RowBatch | None = None):
        with _inference_mode():
            if rows is None:
                return self.runner.launch(seqs, constraints=self.book, lora=self.loras)
            if self.takes_rows:  # the rows as columns (imp.sampling.works.Works)
                return self.runner.launch(Works(rows, seqs), constraints=self.book, lora=self.loras)
            return self.runner.launch(rows.works() + seqs, constraints=self.book, lora=self.loras)

    def _result(self, step: int, tokens: list[SampledToken], rows: RowBatch | None, now: int, elapsed: int,
                dev: int = 0, landed=None) -> StepResult:
        return landed_result(step, tokens, rows, self._hists, now, elapsed, dev, landed)

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, Unload):
            await self._unload(msg.reason)
            return
        if isinstance(msg, Reload):
            await self._load("resume")
            return
        if isinstance(msg, LoraLoad):
            await self._lora_load(msg)
            return
        if isinstance(msg, LoraUnload):
            if self.loras is not None:
                self.loras.remove(msg.lora_id)
            self.send("ingress", LoraState(self.name, msg.lora_id, False))
            return
        if isinstance(msg, (KvSave, KvLoad, KvDrop)):
            await self._tier_op(msg)
            return
        if isinstance(msg, (KvSwapOut, KvSwapIn)):  # on the step thread, in order with the steps (imp.core.kv)
            if self.runner is not None:
                fn = self.runner.swap_out if isinstance(msg, KvSwapOut) else self.runner.swap_in
                await asyncio.get_running_loop().run_in_executor(self._pool, fn, msg)
            return
        if not isinstance(msg, StepPlan):
            return
        if self.runner is None:
            await self._load("request")  # idle-unloaded: the request that woke it waits for this
        if msg.freed and hasattr(self.runner, "forget"):
            self.runner.forget(msg.freed)
        if msg.freed and self.book is not None:
            self.book.forget(msg.freed)
        t0 = time.monotonic_ns()
        loop = asyncio.get_running_loop()
        rows = None
        try:
            seqs, bad = attach_state(msg, self._params, self._hists), None
            if msg.rows is not None and len(msg.rows):
                rows = RowBatch(msg.rows, self._params, self._hists)
        except KeyError as exc:  # a protocol bug: fail the step (in its turn), not the actor
            seqs, rows, bad = [], None, RuntimeError(f"no sampling params for {exc}")
        except ValueError as exc:
            seqs, rows, bad = [], None, RuntimeError(f"bad decode rows: {exc}")
        if self.faults is not None and (seqs or rows) and bad is None:
            self._planned += 1
            try:
                self.faults.check(self._planned)
            except Exception as exc:  # noqa: BLE001 - injected: takes the path a real failure takes
                bad = exc
        if self.pipelined:
            if self._collector is None:
                self._landing = Channel()
                self._collector = asyncio.create_task(self._collect_loop(), name=f"{self.name}-collect")
            try:
                if bad is not None:
                    raise bad
                handle = (await loop.run_in_executor(self._pool, self._launch, seqs, rows) if seqs or rows
                          else None)
                self._landing.put_nowait((msg.step, t0, handle, None, rows))
            except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the server
                if is_device_fault(exc):
                    raise  # the context is poisoned: the actor fails, ingress ends every request
                self._landing.put_nowait((msg.step, t0, None, exc, rows))
            return
        try:
            if bad is not None:
                raise bad
            tokens = await loop.run_in_executor(self._pool, self._run_step, seqs, rows) if seqs or rows else []
        except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the server
            if is_device_fault(exc):
                raise  # the context is poisoned: the actor fails, ingress ends every request
            self._last = {}
            self.send(self.scheduler, StepFailed(msg.step, f"{type(exc).__name__}: {exc}", time.monotonic_ns()))
            return
        now = time.monotonic_ns()
        self.steps += 1
        self.send(self.scheduler, self._result(msg.step, tokens, rows, now, now - t0))

    async def _tier_op(self, msg) -> None:
        """The tiers' I/O: a save copies its block (in the step thread, in order with the steps) before any later
        step writes over it, then writes the file on the tier's own thread without holding the steps back. A load
        runs beside the messages after it, on one of the read threads, and fills its block (in the step thread; on
        the read thread where the runner says `kv_fill_anywhere`, a chunk of blocks at once where it has
        `kv_chunk_blocks`) before the allocator counts it (KvLoaded): no step reads or writes a block being loaded
        (the allocator holds it), so loads need no place in the steps' order. One whose file is not written yet (a
        save still queued) finds nothing: that block is computed, never wrong."""
        r, t = self.runner, self.tier
        loop = asyncio.get_running_loop()
        if t is not None and self._io is None:
            self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-tier")
            self._reads = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"{self.name}-read")
        if isinstance(msg, KvDrop):
            if t is not None:
                loop.run_in_executor(self._io, t.drop, msg.key)
            return
        if isinstance(msg, KvSave):
            if t is not None and r is not None:
                data = await loop.run_in_executor(self._pool, r.kv_block, msg.block)
                loop.run_in_executor(self._io, t.save, msg.key, data)
            return
        if t is not None and r is not None and getattr(r, "kv_chunk_blocks", lambda: 1)() > 1:
            # the loads that arrive together (an alloc's run of blocks) go in chunks: flushed once this
            # actor's inbox is drained (a queued message is taken without yielding to the loop)
            self._chunking.append(msg)
            if len(self._chunking) == 1:
                loop.call_soon(self._flush_loads)
            return
        self._track(self._load_block(msg, r, t))

    def _track(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._loading.add(task)
        task.add_done_callback(self._loading.discard)

    def _flush_loads(self) -> None:
        msgs, self._chunking = self._chunking, []
        r, t = self.runner, self.tier
        if r is None or t is None:  # unloaded meanwhile: nothing to fill, the allocator forgets them
            for m in msgs:
                self._track(self._load_block(m, r, t))
            return
        # chunks of up to the runner's size, and at least one a read thread while there are that many loads
        k = max(1, min(r.kv_chunk_blocks(), -(-len(msgs) // READ_THREADS)))
        for i in range(0, len(msgs), k):
            self._track(self._load_chunk(msgs[i:i + k], r, t))

    async def _load_chunk(self, msgs: list, r, t) -> None:
        loop = asyncio.get_running_loop()
        burst = self._burst
        if burst is None or burst.done:
            burst = self._burst = _Burst(time.monotonic())
        burst.flying += 1
        try:
            got, dt, ds = await loop.run_in_executor(self._reads, _fetch_fill_chunk, t, r,
                                                     [(m.key, m.block) for m in msgs])
        except Exception:  # noqa: BLE001 - a failed chunk is computed again, never a lost answer
            log.exception("[tier] a chunk of %d loads failed; computed instead", len(msgs))
            got, dt, ds = [(False, "")] * len(msgs), 0.0, 0.0
        burst.read_s += dt
        burst.set_s += ds
        burst.blocks += sum(ok for ok, _ in got)
        burst.flying -= 1
        self._burst_done(burst, r)
        for m, (ok, source) in zip(msgs, got):
            self.send(self.kv, KvLoaded(m.key, m.block, ok, source))

    async def _load_block(self, msg: KvLoad, r, t) -> None:
        loop = asyncio.get_running_loop()
        ok, source = False, ""
        burst = self._burst
        if burst is None or burst.done:
            burst = self._burst = _Burst(time.monotonic())
        burst.flying += 1
        if t is not None and r is not None and getattr(r, "kv_fill_anywhere", False):
            (ok, source), dt, ds = await loop.run_in_executor(self._reads, _fetch_fill, t, r, msg.key, msg.block)
            burst.read_s += dt
            burst.set_s += ds
            burst.blocks += ok
        elif t is not None and r is not None:  # unloaded (suspend): nothing to fill, the allocator forgets it
            (data, source), dt = await loop.run_in_executor(self._reads, _timed, _fetch, t, r, msg.key)
            burst.read_s += dt
            if data is not None:  # on the step thread: the CPU pool's copy in order with its steps
                _, dt = await loop.run_in_executor(self._pool, _timed, r.set_kv_block, msg.block, data)
                burst.set_s += dt
                burst.blocks += 1
                ok = True
        burst.flying -= 1
        self._burst_done(burst, r)
        self.send(self.kv, KvLoaded(msg.key, msg.block, ok, source))

    def _burst_done(self, burst: "_Burst", r) -> None:
        if burst.flying:
            return
        burst.done = True  # the last in flight landed: one line a burst (a restart's prompt read back)
        if burst.blocks and r is not None:
            log.info("[tier] %d blocks (%.2f GB) loaded in %.3f s: reads %.3f s on %d threads, block copies "
                     "%.3f s on %s", burst.blocks, burst.blocks * r.kv_block_bytes() / 1e9,
                     time.monotonic() - burst.t0, burst.read_s, READ_THREADS, burst.set_s,
                     "the read threads" if getattr(r, "kv_fill_anywhere", False) else "the step thread")

    async def _lora_load(self, msg: LoraLoad) -> None:
        loop = asyncio.get_running_loop()
        if self.runner is None:
            await self._load("request")
        runner = self.runner
        if self.loras is None or self.lora_reader is None:
            self.send("ingress", LoraState(self.name, msg.lora_id, False, error="this engine runs without LoRA"))
            return
        if not getattr(runner, "supports_lora", False):
            self.send("ingress", LoraState(self.name, msg.lora_id, False,
                                           error=f"this model's {type(runner).__name__} cannot run LoRA adapters"))
            return
        cfg = runner.config
        try:  # reading and checking the file is disk work: off the loop, on the step thread
            ad = await loop.run_in_executor(self._pool, self.lora_reader, msg.path, cfg)
        except ValueError as exc:  # the adapter's fault (imp.formats.lora.LoraError): the caller's 400
            self.send("ingress", LoraState(self.name, msg.lora_id, False, error=str(exc)))
            return
        self.loras.add(msg.lora_id, ad, cfg.n_layers)
        self.send("ingress", LoraState(self.name, msg.lora_id, True, nbytes=ad.nbytes))

    def _measure(self) -> tuple[int, int]:
        return memory.rss_bytes(), memory.device_free_bytes(self.device)

    async def _unload(self, reason: str) -> None:
        if self.runner is None:  # released already (an idle unload, a second suspend): say so
            self.send("ingress", MemoryState(self.name, False, reason, 0.0))
            return
        if self.loader is None:
            self.send("ingress", MemoryState(self.name, True, reason, 0.0, error="this runner cannot be unloaded"))
            return
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        rss0, dev0 = await loop.run_in_executor(self._pool, self._measure)
        self.runner, self._last = None, {}
        if self.book is not None:
            self.book.forget(list(self._params))
        self._params.clear()
        self._hists.clear()
        await loop.run_in_executor(self._pool, memory.release, self.device)
        rss1, dev1 = await loop.run_in_executor(self._pool, self._measure)
        state = MemoryState(self.name, False, reason, time.monotonic() - t0, rss0, rss1, dev0, dev1)
        self.send("metrics", state)
        self.send("ingress", state)

    async def _load(self, reason: str) -> None:
        """Build the runner again (a failure is a fault: the actor stops, requests end)."""
        if self.runner is not None:
            if reason == "resume":  # nothing to load: still answer the caller that waits
                self.send("ingress", MemoryState(self.name, True, reason, 0.0))
            return
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        rss0, dev0 = await loop.run_in_executor(self._pool, self._measure)
        runner = await loop.run_in_executor(self._pool, self.loader)
        if runner.fingerprint != self.fingerprint:
            raise RuntimeError(f"the model file changed while suspended ({self.fingerprint} -> {runner.fingerprint})")
        self.runner = runner
        rss1, dev1 = await loop.run_in_executor(self._pool, self._measure)
        state = MemoryState(self.name, True, reason, time.monotonic() - t0, rss0, rss1, dev0, dev1)
        self.send("metrics", state)
        self.send("ingress", state)

    async def _collect_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step, t0, handle, exc, rows = await self._landing.get()
            tokens: list[SampledToken] = []
            landed = None
            if exc is None and handle is not None:
                try:
                    if rows is not None and self.takes_rows:  # (seq_ids, ids) or tokens: no SampledToken a row
                        sids, ids, tokens = await loop.run_in_executor(self._waiter, self.runner.collect_ids, handle)
                        landed = (sids, ids) if tokens is None else None
                    else:
                        tokens = await loop.run_in_executor(self._waiter, self.runner.collect, handle)
                except Exception as e:  # noqa: BLE001
                    exc = e
            now = time.monotonic_ns()
            if exc is not None and is_device_fault(exc):
                await self.on_failure(exc)  # as if the actor's own task had raised
                return
            if exc is not None:
                self.send(self.scheduler, StepFailed(step, f"{type(exc).__name__}: {exc}", now))
                continue
            self.steps += 1
            timed = getattr(self.runner, "device_ns", None)  # the device's own time, where the runner has it
            dev = timed(handle) if timed is not None and handle is not None else 0
            self.send(self.scheduler, self._result(step, tokens or [], rows, now, now - t0, dev, landed))

    async def on_stop(self) -> None:
        if self._collector is not None:
            self._collector.cancel()
        if self._own_pool:  # a lent one outlives this actor
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._waiter.shutdown(wait=False, cancel_futures=True)
        if self._io is not None:  # the tier's pending writes finish: a cache file is whole or absent
            self._io.shutdown(wait=True)
            self._reads.shutdown(wait=False, cancel_futures=True)
