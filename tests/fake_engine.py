"""An in-process fake engine behind the engine port, for fast dialect tests.

It implements `imp.engine.port.EnginePort` with no model: each submitted
request plays a `Script` — text pieces (tokenized with the test tokenizer so
token counts are real), a finish reason, optional delays, a refusal before
the first delta, or a fault after k deltas. Stop strings are applied as the
port's stream applies them (imp.engine.render), simplified. Everything the dialects send is recorded
(`submissions`, `cancelled`, `reports`, `end_thinking_calls`) so a test can
assert on what crossed the port.

`text_model()` builds a TextModel over a synthetic byte-level tokenizer with
a ChatML template: no download, no weights, milliseconds.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from imp.engine.port import ModelCard, Rates, Snapshot, Submission, SuspendResult
from imp.messages import (
    Delta, Fault, FinishReason, KvFigures, QueueFigures, Reject, RequestStats, SampledToken, TokenOut,
)
from imp.text.chat_template import CHATML, ChatTemplate
from imp.text.model import TextModel
from imp.text.tokenizer import Tokenizer


@functools.lru_cache(maxsize=1)
def text_model() -> TextModel:
    from tests.fixtures.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tempfile.mkdtemp(prefix="imp-fake-") + "/tok.gguf", n_layers=1, d_model=32,
                                n_heads=2, n_kv_heads=1, d_ff=32, vocab=300)
    tok = Tokenizer.from_gguf(path)
    return TextModel.build(tok, ChatTemplate(CHATML, "", "<|im_end|>"), {})


@dataclass
class Script:
    pieces: list[str] = field(default_factory=lambda: ["Hello", " world", "!"])
    finish: FinishReason = FinishReason.STOP
    delay_s: float = 0.0  # before each piece
    first_delay_s: float = 0.0  # before the first piece too (a queue wait or a long prefill)
    reject: Reject | None = None  # refused before anything runs
    fault_after: int | None = None  # an actor Fault after this many pieces
    step_error_after: int | None = None  # a failed step (Delta with error) after this many pieces
    cached_tokens: int = 0


class FakeEngine:
    def __init__(self, script: Script | Callable[[Submission], Script] | None = None,
                 tm: TextModel | None = None, context_length: int = 2048):
        self.tm = tm or text_model()
        self.script = script or Script()
        self.card = ModelCard(
            name="fake-model", path="/models/fake-model.gguf", fingerprint="0" * 64,
            context_length=context_length, vocab_size=self.tm.tokenizer.vocab_size, block_size=16, kv_blocks=256,
            kv_bytes_per_token=4096, replicas=1, max_batch_size=8, max_queued_tokens=0, retry_after_s=1.0,
            device="cpu", created=1_700_000_000, logit_lens=True,
        )
        self.submissions: list[Submission] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.reports: list[RequestStats] = []
        self.end_thinking_calls: list[tuple[str, tuple[int, ...]]] = []
        self.closed_sessions: list[str] = []
        self.live: set[str] = set()
        self.suspended = False
        self.draining = False
        self._fault: str | None = None
        self.store = FakeStore()

    # lifecycle
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    @property
    def fault(self) -> str | None:
        return self._fault

    def _script(self, sub: Submission) -> Script:
        return self.script(sub) if callable(self.script) else self.script

    def submit(self, sub: Submission) -> AsyncIterator:
        self.submissions.append(sub)
        self.live.add(sub.req_id)
        return self._play(sub, self._script(sub))

    async def _play(self, sub: Submission, sc: Script):
        done = False
        try:
            if self.suspended:
                yield Reject(sub.req_id, 503, "suspended", "the server is suspended (POST /admin/resume)")
                done = True
                return
            if sc.reject is not None:
                yield sc.reject
                done = True
                return
            for index in range(sub.n):
                async for d in self._choice(sub, sc, index):
                    yield d
            done = True
        finally:
            self.live.discard(sub.req_id)
            (self.finished if done else self.cancelled).append(sub.req_id)

    async def _choice(self, sub: Submission, sc: Script, index: int):
        tok = self.tm.tokenizer
        text_so_far, produced = "", 0
        limit = sub.params.max_tokens
        pieces = list(sc.pieces)
        for k, piece in enumerate(pieces):
            if k == 0 and sc.first_delay_s:
                await asyncio.sleep(sc.first_delay_s)
            if sc.delay_s:
                await asyncio.sleep(sc.delay_s)
            else:
                await asyncio.sleep(0)
            if sc.fault_after is not None and k >= sc.fault_after:
                self._fault = "executor failed: RuntimeError: injected"
                yield Fault("executor", self._fault)
                return
            if sc.step_error_after is not None and k >= sc.step_error_after:
                yield Delta(TokenOut(sub.req_id, index, (), FinishReason.ERROR, len(sub.prompt), 0, produced,
                                     error="RuntimeError: injected step failure"), "", FinishReason.ERROR)
                return
            ids = tok.encode(piece)
            cut = False
            if produced + len(ids) >= limit:  # the token budget ends inside this piece
                ids = ids[: limit - produced]
                piece = tok.decode(ids)
                cut = True
            produced += len(ids)
            hit = next((s for s in sub.stop if s in text_so_far + piece), None)
            if hit:
                whole = text_so_far + piece
                piece = whole[: whole.index(hit)][len(text_so_far):]
                yield self._delta(sub, index, piece, ids, FinishReason.STOP, produced, sc, stop_str=hit)
                return
            last = cut or k == len(pieces) - 1
            finish = (FinishReason.LENGTH if cut else sc.finish) if last else FinishReason.NONE
            text_so_far += piece
            yield self._delta(sub, index, piece, ids, finish, produced, sc)
            if last:
                return
        yield self._delta(sub, index, "", [], sc.finish, produced, sc)  # an empty script

    def _delta(self, sub, index, text, ids, finish, produced, sc, stop_str="") -> Delta:
        lps = []
        if sub.params.logprobs >= 0:
            k = sub.params.logprobs
            lps = [SampledToken(sub.req_id, t, -0.5, tuple((t + j, -0.5 - j) for j in range(k))) for t in ids]
        out = TokenOut(sub.req_id, index, tuple(ids), finish, len(sub.prompt), sc.cached_tokens, produced,
                       tuple(lps))
        return Delta(out, text, finish, stop_str)

    # control
    def end_thinking(self, req_id: str, token_ids: tuple[int, ...]) -> bool:
        self.end_thinking_calls.append((req_id, tuple(token_ids)))
        return req_id in self.live

    def close_session(self, session_id: str) -> None:
        self.closed_sessions.append(session_id)

    def serve_peers(self, handler) -> None:
        self.peer_handler = handler

    async def ask_peers(self, action: str, some_id: str):
        return None

    async def suspend(self, drain_s: float) -> SuspendResult:
        self.suspended = True
        return SuspendResult(suspended=True, drained=not self.live, in_flight=len(self.live), kv_released=False)

    async def resume(self):
        from imp.engine.port import ResumeResult

        self.suspended = False
        return ResumeResult(suspended=False, reloaded=False)

    def loras(self):
        return ()

    def lora_named(self, name: str):
        return None

    async def lora_load(self, path, name):
        from imp.engine.port import LoraRefused

        raise LoraRefused(400, "lora_load_failed", "the fake engine has no model")

    async def lora_unload(self, lora_id, name):
        from imp.engine.port import LoraRefused

        raise LoraRefused(404, "lora_not_found", "no LoRA adapter")

    async def drain(self, timeout_s: float) -> int:
        self.draining = True
        return 0

    def report(self, stats: RequestStats) -> None:
        self.reports.append(stats)

    async def metrics_text(self) -> bytes:
        return b"# fake\nimp_model_loaded{model=\"fake-model\"} 1.0\n"

    async def warm(self, prompt, salt: str = ""):
        from imp.engine.port import Warm

        return Warm(0, "miss")

    async def snapshot(self, with_live: bool = False) -> Snapshot:
        kv = KvFigures(256, 256, 0, 0, 0, 16)
        return Snapshot(kv=kv, replica_kv=(kv,), queue=QueueFigures(0, len(self.live), 0), rates=Rates(),
                        suspended=self.suspended, draining=self.draining, fault=self._fault, rejections=0,
                        last_reject_reason=None, in_flight=len(self.live), uptime_s=time.monotonic() % 100)


class FakeStore:
    """The Responses store client's API over a dict (same StoreReply answers as the actor's)."""

    def __init__(self):
        self.rows: dict[str, tuple] = {}  # id -> (response_json, input_items, previous_response_id)
        self.fail_puts = False

    async def put(self, response_id, response_json, input_items=(), *, previous_response_id="", created_at=None,
                  model=""):
        from imp.messages import StoreReply, StoreStatus

        if self.fail_puts:
            return StoreReply("x", False, StoreStatus.FAILED, "disk full (injected)")
        self.rows[response_id] = (response_json, tuple(input_items), previous_response_id)
        return StoreReply("x", True)

    async def get(self, response_id):
        from imp.messages import StoreReply, StoreStatus

        row = self.rows.get(response_id)
        if row is None:
            return StoreReply("x", False, StoreStatus.NOT_FOUND, "no such response")
        return StoreReply("x", True, response_json=row[0])

    async def chain(self, response_id):
        from imp.messages import ChainLink, StoreReply, StoreStatus

        if response_id not in self.rows:
            return StoreReply("x", False, StoreStatus.NOT_FOUND, "no such response")
        links, rid, missing = [], response_id, ""
        while rid:
            row = self.rows.get(rid)
            if row is None:
                missing = rid
                break
            links.append(ChainLink(rid, row[2], row[0], row[1]))
            rid = row[2]
        return StoreReply("x", True, chain=tuple(reversed(links)), missing=missing)

    async def delete(self, response_id):
        from imp.messages import StoreReply, StoreStatus

        if self.rows.pop(response_id, None) is None:
            return StoreReply("x", False, StoreStatus.NOT_FOUND, "no such response")
        return StoreReply("x", True)

    async def input_items(self, response_id, *, after="", limit=20, order="desc"):
        from imp.messages import StoreReply, StoreStatus

        row = self.rows.get(response_id)
        if row is None:
            return StoreReply("x", False, StoreStatus.NOT_FOUND, "no such response")
        items = list(row[1]) if order == "asc" else list(reversed(row[1]))
        if after:
            ids = [i.id for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        return StoreReply("x", True, items=tuple(items[:limit]), has_more=len(items) > limit)


async def fake_client(script=None, config=None, grammars=None, **kw):
    """The real app (create_app) over a FakeEngine, started: an aiohttp TestClient with the
    engine at `.engine`. The caller closes it."""
    from aiohttp.test_utils import TestClient, TestServer

    from imp.config import ServerConfig
    from imp.http.app import create_app

    eng = FakeEngine(script, **kw)
    c = TestClient(TestServer(create_app(eng, eng.tm, config or ServerConfig(), grammars=grammars)))
    await c.start_server()
    c.engine = eng
    return c
