"""Models on demand in an API-server process: the fleet lives in the engine process, HTTP routes by model here.

The engine process decides what is resident (imp.engine.fleet); this process asks it, over the one ZMQ
link (imp.engine.remote.RemoteEngine), which model a name means and waits there while it loads
("model_use": the answer carries the model's card). The text side of each model — tokenizer, chat
template, grammar vocabulary — is read here from the model's file the first time a request names it
(the weights stay with the engine). A request's Open names its model: the engine takes the lease there,
so a model swapped out between the two is loaded again before the request runs, never bypassing the budget.

`RemoteModel` is one model's EnginePort seen from here: the link's own calls, scoped to the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Callable

from imp.engine import wire
from imp.engine.port import LoraRefused, ModelCard, ModelRefused, Snapshot, Submission, Warm
from imp.engine.remote import EngineGone


def _refused(exc: Exception) -> ModelRefused:
    if isinstance(exc, LoraRefused):  # the link raises a refused call as LoraRefused: its status and code
        return ModelRefused(exc.status, exc.code, exc.message, retry_after=5.0 if exc.status == 503 else None)
    return ModelRefused(503, "engine_faulted", str(exc))


class RemoteModel:
    """One fleet model's port over the link: per-model calls carry its name."""

    def __init__(self, conn, name: str, card: ModelCard, tokenizer):
        self.conn, self.name, self.card, self.tokenizer = conn, name, card, tokenizer

    fault = property(lambda self: self.conn.fault)
    store = property(lambda self: self.conn.store)

    def submit(self, sub: Submission):
        return self.conn.submit(sub, tokenizer=self.tokenizer, model=self.name)

    async def snapshot(self, with_live: bool = False) -> Snapshot:
        try:
            return await self.conn._call("snapshot", with_live, typ=Snapshot, model=self.name)
        except EngineGone:
            return await self.conn.snapshot(with_live)

    async def warm(self, prompt, salt: str = "") -> Warm:
        try:
            return await self.conn._call("warm", tuple(prompt), salt, typ=Warm, model=self.name)
        except EngineGone:
            return Warm(0, "miss")

    async def lora_load(self, path: str, name: str | None):
        from imp.engine.port import LoraInfo

        try:
            return await self.conn._call("lora_load", path, name, typ=LoraInfo, model=self.name)
        except EngineGone as exc:
            raise LoraRefused(409, "engine_faulted", str(exc)) from None

    async def lora_unload(self, lora_id: int | None, name: str | None):
        from imp.engine.port import LoraInfo

        try:
            return await self.conn._call("lora_unload", lora_id, name, typ=LoraInfo, model=self.name)
        except EngineGone as exc:
            raise LoraRefused(409, "engine_faulted", str(exc)) from None

    def loras(self):
        return self.conn.model_loras.get(self.name, ())

    def lora_named(self, name: str) -> int | None:
        return next((a.id for a in self.loras() if a.name == name), None)

    def __getattr__(self, attr):  # the rest (end_thinking, report, close_session, peers, ...) is the link's
        return getattr(self.conn, attr)


class RemoteFleet:
    """imp.engine.port.Models over the link. text_for: (model path) -> (TextModel, GrammarCache), read from the
    file (blocking: run on a worker thread); boot: the boot model's (path, text, grammars), read at start."""

    def __init__(self, conn, text_for: Callable[[str], tuple], boot: tuple):
        self.conn, self.text_for = conn, text_for
        self.default = conn.default_model
        path, text, grammars = boot
        self._texts: dict[str, tuple] = {os.path.realpath(path): (text, grammars)}  # by the file's real path
        self._reading: dict[str, asyncio.Future] = {}
        self._views: dict[str, RemoteModel] = {}
        conn.on_state = self._prefetch

    def _prefetch(self) -> None:
        """A model became resident (an admin load, another server's request): its text side is read now, so
        the first request here does not wait for it (Gemma's 262k-token grammar vocabulary: ~2 s)."""
        for card in self.conn.models.values():
            path = os.path.realpath(card.path)
            if path not in self._texts and path not in self._reading:
                t = asyncio.ensure_future(self._text(path))
                t.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure shows at the request
    async def _text(self, path: str) -> tuple:
        path = os.path.realpath(path)
        got = self._texts.get(path)
        if got is not None:
            return got
        fut = self._reading.get(path)
        if fut is None:  # one read per model, shared by the requests that wait for it
            fut = self._reading[path] = asyncio.ensure_future(asyncio.to_thread(self.text_for, path))
        try:
            got = self._texts[path] = await asyncio.shield(fut)
        finally:
            if fut.done():
                self._reading.pop(path, None)
        return got

    def _view(self, name: str, card: ModelCard, tokenizer) -> RemoteModel:
        v = self._views.get(name)
        if v is None or v.card != card or (tokenizer is not None and v.tokenizer is not tokenizer):
            v = self._views[name] = RemoteModel(self.conn, name, card, tokenizer)
        return v

    @contextlib.asynccontextmanager
    async def serve(self, name: str, timeout_s: float = 0.0, load: bool = True):
        try:
            use = await self.conn._call("model_use", name, load, typ=wire.ModelUse, timeout_s=timeout_s or None)
        except (LoraRefused, EngineGone) as exc:
            if isinstance(exc, EngineGone) and "did not answer" in str(exc):
                raise asyncio.TimeoutError from None
            raise _refused(exc) from None
        text, grammars = await self._text(use.path)
        yield self._view(use.name, use.card, text.tokenizer), text, grammars

    async def _ask(self, method: str, *args, typ=None):
        try:
            return await self.conn._call(method, *args, typ=typ)
        except (LoraRefused, EngineGone) as exc:
            raise _refused(exc) from None

    async def rows(self) -> list[dict]:
        return await self._ask("models_rows", typ=list)

    async def status(self) -> dict:
        try:
            return await self.conn._call("models_status", typ=dict)
        except (LoraRefused, EngineGone):
            return {"swapping": None, "loaded": []}

    async def resident(self) -> list[dict]:
        return await self._ask("models_resident", typ=list)

    async def load_row(self, name: str) -> dict:
        row = await self._ask("models_load", name, typ=dict)
        try:  # loaded means ready to serve here too: its text side read before the answer
            use = await self.conn._call("model_use", name, False, typ=wire.ModelUse)
            await self._text(use.path)
        except (LoraRefused, EngineGone):  # swapped out again already: the next request loads it
            pass
        return row

    async def unload_row(self, name: str, drain_s: float | None = None) -> dict:
        return await self._ask("models_unload", name, drain_s, typ=dict)

    async def metrics_text(self) -> bytes:
        return await self.conn.metrics_text()

    async def suspend(self, drain_s: float):
        return await self.conn.suspend(drain_s)  # the engine host suspends its fleet

    async def resume(self):
        return await self.conn.resume()

    def ports(self) -> list:
        """The resident models (from the engine's last State) as ports; their tokenizers are not needed for
        what these serve (LoRA admin)."""
        return [self._view(n, card, None) for n, card in self.conn.models.items()]

    async def drain(self, timeout_s: float) -> int:
        return await self.conn.drain(timeout_s)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
