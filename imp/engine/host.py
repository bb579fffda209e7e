"""The engine process's side of the process boundary: a LocalEngine served over ZMQ.

API-server processes (`imp.engine.remote.RemoteEngine`) connect a DEALER to this
ROUTER. Each frame they send becomes a call on the engine (`imp.engine.local`),
so what it asks is still a message on the engine's bus and in its event log;
what comes back is token ids (the detok actor runs raw), batched: every Delta,
Reject and decode lane row delivered in one event-loop turn goes out as one `Items`
frame per API server (runs of rows as one TokenRows). Nothing here decides
anything: admission, scheduling and the KV stay with the actors.

An API server that dies (its pid is gone, or it says Hello again after a
restart) has its open requests cancelled, so no KV block outlives its client.
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec
import zmq
import zmq.asyncio

from imp.engine import wire
from imp.engine.port import LoraRefused, ModelRefused
from imp.messages import Fault, Reject, token_rows

log = logging.getLogger("imp.engine.host")


class _Peer:
    __slots__ = ("ident", "api", "pid", "open", "out", "pending")

    def __init__(self, ident: bytes, api: int, pid: int):
        self.ident, self.api, self.pid = ident, api, pid
        self.open: dict[str, tuple] = {}  # req_id -> (engine, ingress handle, lora id, fleet Model or None)
        self.out: list = []  # Items not yet sent this turn
        self.pending: set[str] = set()  # requests waiting for their model (a swap); a Close takes one out


class _Sink:
    """Stands in for a request handle's queue: what ingress delivers goes to the peer."""

    __slots__ = ("host", "peer", "handle", "own")

    def __init__(self, host: "EngineHost", peer: _Peer, handle, own: bool = False):
        self.host, self.peer, self.handle = host, peer, handle
        self.own = own  # a fleet model's engine (not the boot one): its fault is this request's alone

    def put_nowait(self, item) -> None:
        if type(item) is tuple:  # a decode lane row's token: (request id, index, token) in the turn's TokenRows
            self.peer.out.append((self.handle.req_id, item[0], item[1]))
            self.host._wake()
            return
        if isinstance(item, Fault):  # the boot engine's: said once to every peer, as State
            if self.own:
                item = Reject(self.handle.req_id, 500, "engine_faulted", item.error)
            else:
                self.host._check_fault()
                return
        self.peer.out.append(item)
        self.host._wake()
        if self.handle.done:
            self.host._finished(self.peer, self.handle.req_id)



class EngineHost:
    """Serves `engine` (an imp.engine.local.LocalEngine: its handles carry token ids) to the
    API servers connecting to `endpoint` (an ipc:// or tcp:// ZMQ address)."""

    def __init__(self, engine, endpoint: str, grammars=None, watch_s: float = 0.25, rate_take=None, fleet=None):
        """rate_take: (caller) -> seconds to wait, --rate-limit's one set of buckets for every
        API server (injected at boot), or None; fleet: models on demand (imp.engine.fleet.Fleet, whose boot
        model's engine is `engine`), or None."""
        self.engine = engine
        self.fleet = fleet
        if fleet is not None:  # a swap changes the resident models and drops adapters: every API server hears
            fleet.on_change = self._broadcast_state
        self.endpoint = endpoint
        self.grammars = grammars  # compile a request's grammar here before it is queued
        self.rate_take = rate_take
        self.watch_s = watch_s
        self.peers: dict[bytes, _Peer] = {}
        self._fault = ""
        self._wake_pending = False
        self._tasks: list[asyncio.Task] = []
        self._calls: set[asyncio.Task] = set()
        self._asks: dict[int, list] = {}  # peer control: ask id -> [asker, its call id, answers still due]
        self._ask_ids = 0

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a frame: the engine's output is bounded by its batch
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.bind(self.endpoint)
        self._tasks = [asyncio.create_task(self._read(), name="host-read"),
                       asyncio.create_task(self._watch(), name="host-watch")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in list(self._calls):
            t.cancel()
        self._flush()
        self.sock.close()
        self.ctx.term()

    def bye(self) -> None:
        """Tell every API server the engine is done (after the drain: every Items is out)."""
        for p in self.peers.values():
            p.out.append(wire.Bye())
        self._flush()

    # ------------------------------------------------------------------ output

    def _wake(self) -> None:
        if not self._wake_pending:  # one send per peer per loop turn, whatever the number of streams
            self._wake_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._wake_pending = False
        for p in self.peers.values():
            if p.out:
                frames, p.out = p.out, []
                self._send(p.ident, _batched(frames))

    def _send(self, ident: bytes, frames: list) -> None:
        wire.sent(self.sock.send_multipart([ident, wire.encode(frames)], copy=False))

    def _reply(self, peer: _Peer, frame) -> None:
        peer.out.append(frame)
        self._wake()

    def _state(self) -> wire.State:
        if self.fleet is None:
            return wire.State(fault=self._fault, loras=self.engine.loras())
        res = {n: m for n, m in self.fleet.models.items() if m.loaded}
        return wire.State(fault=self._fault, loras=self.engine.loras(),
                          models={n: m.engine.card for n, m in res.items()},
                          model_loras={n: m.engine.loras() for n, m in res.items()})

    def _broadcast_state(self) -> None:
        st = self._state()
        for p in self.peers.values():
            p.out.append(st)
        self._wake()

    def _check_fault(self) -> None:
        f = self.engine.fault or ""
        if f != self._fault:
            self._fault = f
            self._broadcast_state()

    def _finished(self, peer: _Peer, req_id: str) -> None:
        peer.pending.discard(req_id)
        ent = peer.open.pop(req_id, None)
        if ent is not None:
            eng, h, lora, m = ent
            eng.close(h, lora)
            if m is not None:  # the request's lease on its model ends (imp.engine.fleet)
                self.fleet.release(m)

    # ------------------------------------------------------------------ input

    async def _read(self) -> None:
        while True:
            ident, data = await self.sock.recv_multipart()
            try:
                frames = wire.decode(data)
            except msgspec.DecodeError as exc:  # a peer of another build: say so, drop it
                log.error("undecodable frame from an API server: %s", exc)
                continue
            for f in frames:
                try:
                    self._on(ident, f)
                except Exception:  # noqa: BLE001 - one bad frame must not stop the engine's door
                    log.exception("frame %s from an API server failed", type(f).__name__)

    def _on(self, ident: bytes, f) -> None:
        eng = self.engine
        peer = self.peers.get(ident)
        if type(f) is wire.Hello:
            for old in [p for p in self.peers.values() if p.api == f.api or p.ident == ident]:
                self._drop(old, "restarted")
            peer = self.peers[ident] = _Peer(ident, f.api, f.pid)
            self._reply(peer, wire.Welcome(eng.card, os.getpid(), eng.loras(), eng.store is not None,
                                           self.fleet.default if self.fleet is not None else ""))
            self._reply(peer, self._state())
            log.info("API server %d (pid %d) connected", f.api, f.pid)
            return
        if peer is None:
            log.warning("frame %s from an API server that did not say Hello", type(f).__name__)
            return
        t = type(f)
        if t is wire.Open and f.model and self.fleet is not None:
            peer.pending.add(f.sub.req_id)
            self._spawn(self._open_model(peer, f.sub, f.model))
        elif t is wire.Open:
            c = f.sub.params.constraint
            if c is not None and self.grammars is not None and self.grammars.get(c) is None:
                self._spawn(self._open_compiled(peer, f.sub))  # compiled off the loop, then queued
            else:
                self._open(peer, f.sub)
        elif t is wire.Close:
            self._finished(peer, f.req_id)
        elif t is wire.StopChoice:
            if f.req_id in peer.open:
                peer.open[f.req_id][0].stop_choice(f.req_id, f.index)
        elif t is wire.Think:
            ent = peer.open.get(f.req_id)
            (ent[0] if ent is not None else eng).end_thinking(f.req_id, f.token_ids)
        elif t is wire.SessionEnd:
            eng.close_session(f.session_id)
        elif t is wire.Report:
            self._engine_of(f.stats.model if self.fleet is not None else "").report(f.stats)
        elif t is wire.Call:
            self._spawn(self._call(peer, f))
        elif t is wire.StoreCall:
            self._spawn(self._store(peer, f))
        elif t is wire.ControlReply:
            self._control_reply(f)

    def _open(self, peer: _Peer, sub, m=None) -> None:
        """Queue the request on the boot engine, or on fleet model m's (its lease taken already: given back
        if the request is refused here)."""
        eng = self.engine if m is None else m.engine
        try:
            h = eng.open(sub)
        except (LoraRefused, ValueError) as exc:
            if m is not None:
                self.fleet.release(m)
            status, code = (exc.status, exc.code) if isinstance(exc, LoraRefused) else (400, "invalid_request")
            self._reply(peer, Reject(sub.req_id, status, code, getattr(exc, "message", str(exc))))
            return
        h.queue = _Sink(self, peer, h, own=eng is not self.engine)
        peer.open[sub.req_id] = (eng, h, sub.params.lora, m)

    async def _open_model(self, peer: _Peer, sub, name: str) -> None:
        """A request for a fleet model: a lease on it (waiting for a swap if need be), then opened on its
        engine; a refusal is the request's Reject. A request closed while it waited is not opened."""
        rid = sub.req_id
        try:
            entry, _ = self.fleet.resolve(name)
            m = await self.fleet.acquire(entry)
        except ModelRefused as exc:
            if rid in peer.pending:
                peer.pending.discard(rid)
                self._reply(peer, Reject(rid, exc.status, exc.code, exc.message))
            return
        if rid not in peer.pending or self.peers.get(peer.ident) is not peer:
            self.fleet.release(m)  # its client left while the model loaded
            return
        peer.pending.discard(rid)
        await self._open_compiled(peer, sub, m)

    def _engine_of(self, model: str):
        """The engine a per-model call is for: the boot one for "" (or a model never loaded)."""
        if not model or self.fleet is None:
            return self.engine
        m = self.fleet.models.get(model) or next(  # a report names the card's model, which is the fleet's name
            (x for x in self.fleet.models.values() if x.engine.card.name == model), None)
        return m.engine if m is not None else self.engine

    async def _open_compiled(self, peer: _Peer, sub, m=None) -> None:
        """The request's grammar compiled (off the loop) where its engine's cache lacks it, then queued."""
        grammars = self.grammars if m is None else m.grammars
        c = sub.params.constraint
        if c is not None and grammars is not None and grammars.get(c) is None:
            try:
                await grammars.compile(c)
            except Exception:  # noqa: BLE001 - HTTP compiled it already; the book compiles again if need be
                log.debug("grammar for %s did not compile in the engine", sub.req_id, exc_info=True)
        if self.peers.get(peer.ident) is peer:
            self._open(peer, sub, m)
        elif m is not None:
            self.fleet.release(m)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._calls.add(t)
        t.add_done_callback(self._calls.discard)

    async def _call(self, peer: _Peer, f: wire.Call) -> None:
        eng = self._engine_of(f.model)
        fleet = self.fleet
        try:
            if f.method.startswith("model") and fleet is None:
                raise ModelRefused(400, "models_not_enabled", "this engine serves one model")
            if f.method == "model_use":
                v = await self._model_use(*f.args)
            elif f.method == "models_rows":
                v = await fleet.rows()
            elif f.method == "models_status":
                v = await fleet.status()
            elif f.method == "models_resident":
                v = await fleet.resident()
            elif f.method == "models_load":
                v = await fleet.load_row(*f.args)
            elif f.method == "models_unload":
                v = await fleet.unload_row(*f.args)
            elif f.method == "metrics_text" and fleet is not None:
                v = await fleet.metrics_text()
            elif f.method == "snapshot":
                v = eng.figures(*f.args)
            elif f.method == "warm":
                v = eng.warm_now(*f.args)
            elif f.method == "ask_peers":
                self._ask_peers(peer, f)
                return
            elif f.method == "rate_take" and self.rate_take is not None:
                v = float(self.rate_take(*f.args))
            elif f.method == "metrics_text":
                v = await eng.metrics_text()
            elif f.method == "suspend":  # with models on demand, every model's (imp.engine.fleet)
                v = await (fleet or eng).suspend(*f.args)
            elif f.method == "resume":
                v = await (fleet or eng).resume()
            elif f.method == "lora_load":
                v = await eng.lora_load(*f.args)
                self._broadcast_state()
            elif f.method == "lora_unload":
                v = await eng.lora_unload(*f.args)
                self._broadcast_state()
            else:
                raise LoraRefused(400, "unknown_call", f"unknown engine call {f.method!r}")
            self._reply(peer, wire.Answer(f.call_id, wire.raw(v)))
        except (LoraRefused, ModelRefused) as exc:
            self._reply(peer, wire.Answer(f.call_id, status=exc.status, code=exc.code, message=exc.message))
        except Exception as exc:  # noqa: BLE001 - the caller gets an answer, never a hang
            log.exception("engine call %s failed", f.method)
            self._reply(peer, wire.Answer(f.call_id, status=500, code="engine_error", message=str(exc)))

    async def _model_use(self, name: str, load: bool = True) -> wire.ModelUse:
        """The model name resolves to, resident now (loaded if need be: the API server waits in this call,
        its request's timeout on its side); its card is what HTTP checks the request against. load=False:
        ModelRefused 409 model_not_loaded when it is not resident (an estimate never loads a model)."""
        entry, _ = self.fleet.resolve(name)
        m = self.fleet.models.get(entry.name)
        if m is None or not m.loaded or m.leaving:  # a resident model answers at once, even during a swap
            m = await self.fleet.load(entry.name, for_request=True) if load else self.fleet.resident_now(entry.name)
        return wire.ModelUse(entry.name, entry.path, m.engine.card)

    async def _store(self, peer: _Peer, f: wire.StoreCall) -> None:
        store = self.engine.store
        if store is None:
            self._reply(peer, wire.Answer(f.call_id, status=400, code="store_off", message="no Responses store"))
            return
        reply = await store.forward(f.msg)
        self._reply(peer, wire.Answer(f.call_id, wire.raw(reply)))

    # ------------------------------------------------------------------ peers

    def _ask_peers(self, asker: _Peer, f: wire.Call) -> None:
        """A control call for a request another API server runs: ask each of the others;
        the first that has it answers, else the asker hears None."""
        others = [p for p in self.peers.values() if p is not asker]
        if not others:
            self._reply(asker, wire.Answer(f.call_id, wire.raw(None)))
            return
        self._ask_ids += 1
        self._asks[self._ask_ids] = [asker, f.call_id, len(others)]
        action, some_id = f.args
        for p in others:
            self._reply(p, wire.Control(self._ask_ids, action, some_id))

    def _control_reply(self, f: wire.ControlReply) -> None:
        ask = self._asks.get(f.ask_id)
        if ask is None:
            return
        ask[2] -= 1
        if f.body is not None or ask[2] <= 0:
            del self._asks[f.ask_id]
            v = None if f.body is None else [f.status, f.body]
            self._reply(ask[0], wire.Answer(ask[1], wire.raw(v)))

    def _drop(self, peer: _Peer, why: str) -> None:
        """Forget an API server: cancel every request it had open (their KV is freed)."""
        if peer.open:
            log.warning("API server %d (pid %d) %s: cancelling its %d open requests", peer.api, peer.pid, why,
                        len(peer.open))
        for req_id in list(peer.open):
            self._finished(peer, req_id)
        self.peers.pop(peer.ident, None)
        for ask_id, ask in list(self._asks.items()):  # it will not answer: count it as "not here"
            self._control_reply(wire.ControlReply(ask_id))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.watch_s)
            self._check_fault()
            for p in [p for p in self.peers.values() if not wire.alive(p.pid)]:
                self._drop(p, "exited")


def _batched(frames: list) -> list:
    """A turn's output: each run of Deltas/Rejects/rows becomes one Items frame, order kept; a run of rows
    ((request id, index, token) tuples) one TokenRows in it."""
    out, run, rows = [], [], []
    for f in frames:
        if type(f) is tuple:
            rows.append(f)
            continue
        if rows:
            run.append(token_rows(rows))
            rows = []
        if isinstance(f, wire.Frame):
            if run:
                out.append(wire.Items(tuple(run)))
                run = []
            out.append(f)
        else:
            run.append(f)
    if rows:
        run.append(token_rows(rows))
    if run:
        out.append(wire.Items(tuple(run)))
    return out
