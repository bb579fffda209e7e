"""The engine port in an API-server process: the engine is another process, over ZMQ.

Implements `imp.engine.port.EnginePort` for HTTP exactly as the in-process
engine does, so handlers cannot tell. A request's token ids arrive batched
(`wire.Items`, one frame per engine loop turn) and are rendered here: the
incremental detokenizer and the stop strings run in this process
(`imp.engine.render.RenderedStream`, as in one process), and a stop string that
ends a choice is sent back as `StopChoice` so its KV is freed at once. Awaited calls (suspend,
resume, LoRA, the snapshot, /metrics, the store) are `Call` frames answered by
`Answer` frames. Facts a handler reads synchronously (a fault, the LoRA table)
arrive as `State` frames whenever they change.

If the engine process dies, every waiting request gets a Fault
(`engine_faulted`), /health answers 503, and every later request is refused:
nothing waits on an engine that is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

import msgspec
import zmq
import zmq.asyncio

from imp.actors.channel import Channel
from imp.actors.store_client import StoreClient
from imp.engine import wire
from imp.engine.render import RenderedStream
from imp.engine.port import (LoraInfo, LoraRefused, ModelCard, Rates, ResumeResult, Snapshot, Warm,
                             Submission, SuspendResult)
from imp.messages import Fault, KvFigures, QueueFigures, Reject, RequestStats, StoreReply, TokenRows

log = logging.getLogger("imp.engine.remote")


class EngineGone(Exception):
    pass


# calls that wait on a drain or a model load: the engine answers them when done
_SLOW_CALLS = {"suspend": 3600.0, "resume": 600.0, "lora_load": 600.0, "lora_unload": 600.0, "ask_peers": 10.0,
               "model_use": 3600.0, "models_load": 3600.0, "models_unload": 3600.0}


class RemoteEngine:
    """EnginePort over a ZMQ DEALER connected to an `imp.engine.host.EngineHost`."""

    def __init__(self, endpoint: str, tokenizer, api: int = 0, connect_timeout_s: float = 120.0,
                 watch_s: float = 0.25):
        self.endpoint = endpoint
        self.tokenizer = tokenizer  # renders the token ids the engine sends
        self.api = api
        self.connect_timeout_s = connect_timeout_s
        self.watch_s = watch_s
        self.card: ModelCard | None = None
        self.engine_pid = 0
        self.streams: dict[str, RenderedStream] = {}
        self._fault = ""
        self._loras: tuple[LoraInfo, ...] = ()
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._out: list = []
        self._flush_pending = False
        self._welcome: asyncio.Future | None = None
        self._last_snapshot: Snapshot | None = None
        self._tasks: list[asyncio.Task] = []
        self._bye = asyncio.Event()  # the engine drained and stops: the server exits
        self._store: StoreClient | None = None
        self._peer_handler = None  # HTTP's answer to a control call for a request it may run
        self._control_tasks: set[asyncio.Task] = set()
        self.default_model = ""  # models on demand: the fleet's boot model ("" = one model)
        self.models: dict[str, ModelCard] = {}  # the fleet's resident models' cards, from State
        self.model_loras: dict[str, tuple[LoraInfo, ...]] = {}
        self.on_state = None  # () -> None after a State frame (imp.engine.remote_fleet reads its models)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.card is not None:  # connected at boot already (the app starts it again)
            return
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(self.endpoint)
        self._welcome = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._read(), name="remote-read")]
        self._send(wire.Hello(self.api, os.getpid()))
        w = await asyncio.wait_for(self._welcome, self.connect_timeout_s)
        self.card, self.engine_pid = w.card, w.engine_pid
        self._loras = w.loras
        self.default_model = w.default_model
        if w.store:
            self._store = StoreClient(lambda _to, msg: self._store_call(msg), reply_to=f"api{self.api}",
                                      prefix=f"a{self.api}")
        self._tasks.append(asyncio.create_task(self._watch(), name="remote-watch"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._flush()
        self.sock.close()
        self.ctx.term()

    async def wait_bye(self) -> None:
        await self._bye.wait()

    # ------------------------------------------------------------------ frames

    def _send(self, frame) -> None:
        self._out.append(frame)
        if not self._flush_pending:  # one send per loop turn
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._out:
            frames, self._out = self._out, []
            wire.sent(self.sock.send(wire.encode(frames), copy=False))

    async def _read(self) -> None:
        try:
            await self._read_frames()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken link must fail the requests, not hang them
            log.exception("the link to the engine broke")
            self._faulted(f"the link to the engine broke: {type(exc).__name__}: {exc}")

    async def _read_frames(self) -> None:
        while True:
            data = await self.sock.recv()
            for f in wire.decode(data):
                t = type(f)
                if t is wire.Items:
                    streams = self.streams
                    for item in f.items:
                        ti = type(item)
                        if ti is TokenRows:  # decode lane rows: each stream's (index, token)
                            for rid, i, tok in item.rows():
                                s = streams.get(rid)
                                if s is not None:
                                    s.queue.put_nowait((i, tok))
                            continue
                        s = streams.get(item.req_id if ti is Reject else item.out.req_id)
                        if s is not None:
                            s.queue.put_nowait(item)
                elif t is wire.Answer:
                    fut = self._calls.pop(f.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(f)
                elif t is wire.State:
                    self._loras = f.loras
                    self.models, self.model_loras = f.models, f.model_loras
                    if self.on_state is not None:
                        self.on_state()
                    if f.fault and not self._fault:
                        self._faulted(f.fault)
                elif t is wire.Welcome:
                    if self._welcome is not None and not self._welcome.done():
                        self._welcome.set_result(f)
                elif t is wire.Control:
                    self._spawn_control(f)
                elif t is wire.Bye:
                    self._bye.set()

    def _spawn_control(self, f: wire.Control) -> None:
        async def run():
            got = None
            if self._peer_handler is not None:
                try:
                    got = await self._peer_handler(f.action, f.some_id)
                except Exception:  # noqa: BLE001 - answer "not here" rather than leave the asker waiting
                    log.exception("control %s for %s failed", f.action, f.some_id)
            status, body = got if got is not None else (0, None)
            self._send(wire.ControlReply(f.ask_id, status, body))

        t = asyncio.create_task(run())
        self._control_tasks.add(t)
        t.add_done_callback(self._control_tasks.discard)

    async def _watch(self) -> None:
        """The engine process is gone (killed, crashed): fail everything waiting on it now."""
        while not self._fault:
            await asyncio.sleep(self.watch_s)
            if not wire.alive(self.engine_pid):
                self._faulted(f"the engine process (pid {self.engine_pid}) exited")

    def _faulted(self, error: str) -> None:
        self._fault = error
        log.error("engine fault: %s", error)
        fault = Fault("engine", error)
        for s in list(self.streams.values()):
            s.queue.put_nowait(fault)
        if self.engine_pid and error.startswith("the engine process"):
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(EngineGone(error))
            self._calls.clear()
            if self._store is not None:
                self._store.fail_all(error)

    async def _call(self, method: str, *args, typ=None, timeout_s: float | None = None, model: str = ""):
        if self._fault and not wire.alive(self.engine_pid):
            raise EngineGone(self._fault)
        cid = next(self._ids)
        fut = self._calls[cid] = asyncio.get_running_loop().create_future()
        self._send(wire.Call(cid, method, args, model))
        # a live engine that does not answer (hung) must not hang the handler for ever
        limit = timeout_s if timeout_s is not None else _SLOW_CALLS.get(method, 30.0)
        try:
            a: wire.Answer = await asyncio.wait_for(fut, limit)
        except asyncio.TimeoutError:
            self._calls.pop(cid, None)
            raise EngineGone(f"the engine did not answer {method} within {limit:g}s") from None
        if a.status:
            raise LoraRefused(a.status, a.code, a.message)
        return wire.value(a, typ) if typ is not None else None

    def _forget(self, req_id: str) -> None:
        if self.streams.pop(req_id, None) is not None and not self._fault:
            self._send(wire.Close(req_id))

    # ------------------------------------------------------------------ the port

    @property
    def fault(self) -> str | None:
        return self._fault or None

    def submit(self, sub: Submission, tokenizer=None, model: str = "") -> RenderedStream:
        """tokenizer, model: a fleet model's (imp.engine.remote_fleet), else the boot engine's."""
        if sub.req_id in self.streams:
            raise ValueError(f"duplicate request id {sub.req_id}")
        rid = sub.req_id
        s = self.streams[rid] = RenderedStream(tokenizer or self.tokenizer, sub, Channel(),
                                               lambda i: self._send(wire.StopChoice(rid, i)),
                                               lambda: self._forget(rid))
        if self._fault:
            s.queue.put_nowait(Fault("engine", self._fault))
        else:  # stop strings stay here: the engine sends token ids, this process makes the text
            self._send(wire.Open(msgspec.structs.replace(sub, stop=()), model))
        return s

    def end_thinking(self, req_id: str, token_ids: tuple[int, ...]) -> bool:
        s = self.streams.get(req_id)
        if s is None or s.ended or self._fault:
            return False
        self._send(wire.Think(req_id, tuple(token_ids)))
        return True

    def close_session(self, session_id: str) -> None:
        self._send(wire.SessionEnd(session_id))

    async def snapshot(self, with_live: bool = False) -> Snapshot:
        try:
            snap = await self._call("snapshot", with_live, typ=Snapshot)
            self._last_snapshot = msgspec.structs.replace(snap, live=())
            return snap
        except EngineGone:
            last = self._last_snapshot or _empty_snapshot(self.card)
            return msgspec.structs.replace(last, fault=self._fault, in_flight=len(self.streams), live=())

    async def warm(self, prompt, salt: str = "") -> Warm:
        try:
            return await self._call("warm", tuple(prompt), salt, typ=Warm)
        except EngineGone:
            return Warm(0, "miss")

    async def metrics_text(self) -> bytes:
        try:
            return await self._call("metrics_text", typ=bytes)
        except EngineGone:
            return f"# the engine process is gone: {self._fault}\nimp_model_loaded 0\n".encode()

    async def suspend(self, drain_s: float) -> SuspendResult:
        try:
            return await self._call("suspend", drain_s, typ=SuspendResult)
        except EngineGone as exc:
            return SuspendResult(suspended=False, drained=False, in_flight=len(self.streams), kv_released=False,
                                 error=str(exc))

    async def resume(self) -> ResumeResult:
        try:
            return await self._call("resume", typ=ResumeResult)
        except EngineGone:
            return ResumeResult(suspended=False, reloaded=False)

    async def drain(self, timeout_s: float) -> int:
        """The engine process drains itself on SIGTERM; here, wait for this server's streams."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.streams and loop.time() < deadline and not self._fault:
            await asyncio.sleep(0.05)
        return len(self.streams)

    async def lora_load(self, path: str, name: str | None) -> LoraInfo:
        try:
            return await self._call("lora_load", path, name, typ=LoraInfo)
        except EngineGone as exc:
            raise LoraRefused(409, "engine_faulted", str(exc)) from None

    async def lora_unload(self, lora_id: int | None, name: str | None) -> LoraInfo:
        try:
            return await self._call("lora_unload", lora_id, name, typ=LoraInfo)
        except EngineGone as exc:
            raise LoraRefused(409, "engine_faulted", str(exc)) from None

    def serve_peers(self, handler) -> None:
        """handler: async (action, some_id) -> (status, body) or None if not running here."""
        self._peer_handler = handler

    async def ask_peers(self, action: str, some_id: str):
        """The same control call, asked of every other API server: (status, body) or None."""
        try:
            got = await self._call("ask_peers", action, some_id, typ=list | None)
        except EngineGone:
            return None
        return None if got is None else (got[0], got[1])

    async def rate_take(self, caller: str) -> float:
        """--rate-limit, decided in the engine process for every API server at once."""
        try:
            return await self._call("rate_take", caller, typ=float)
        except EngineGone:
            return 0.0  # the request is refused as engine_faulted anyway

    def loras(self) -> tuple[LoraInfo, ...]:
        return self._loras

    def lora_named(self, name: str) -> int | None:
        return next((a.id for a in self._loras if a.name == name), None)

    def report(self, stats: RequestStats) -> None:
        if not self._fault:
            self._send(wire.Report(stats))

    @property
    def store(self):
        return self._store

    def _store_call(self, msg) -> None:
        """StoreClient's send: the request crosses; its Answer is the store's reply."""
        cid = next(self._ids)
        fut = self._calls[cid] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(self._store_answer)
        self._send(wire.StoreCall(cid, msg))

    def _store_answer(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # the engine is gone: fail_all answered the waiting calls
        a: wire.Answer = fut.result()
        if not a.status and self._store is not None:
            self._store.deliver(wire.value(a, StoreReply))


def _empty_snapshot(card: ModelCard | None) -> Snapshot:
    n = card.kv_blocks if card is not None else 0
    bs = card.block_size if card is not None else 16
    kv = KvFigures(n, n, 0, 0, 0, bs)
    return Snapshot(kv=kv, replica_kv=(kv,), queue=QueueFigures(0, 0, 0), rates=Rates(), suspended=False,
                    draining=False, fault=None, rejections=0, last_reject_reason=None, in_flight=0, uptime_s=0.0)

