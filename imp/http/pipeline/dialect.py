"""What a dialect is: a parser of its wire body and a renderer of engine events.

A dialect (`imp/http/dialects/<name>/`) is two small things the pipeline
(`imp.http.pipeline.run`) calls, and nothing else:

- `parse(body, ctx)`: its wire body -> the typed `GenerateRequest` (plus any
  `extra` its renderer needs: Responses keeps its echo fields there), every
  field checked, errors as `ApiError` naming the field;
- `renderer(job)`: a `Renderer` that turns the engine's `Delta`s back into its
  wire format — one JSON body (`take` each delta, then `body`), or SSE bytes
  (`start`, `delta`, `keepalive`, `end`, `error`).

Everything between the two — the constraint compile, the template render and
tokenization, the sampling defaults and context limits, the engine port, the
keep-alives, usage figures, the live-request table, errors before and after the
stream started — is the pipeline's, written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from imp.engine.port import EnginePort, ModelCard
from imp.http.pipeline import resolve
from imp.http.pipeline.request import GenerateRequest
from imp.messages import Delta, SamplingParams
from imp.text.model import TextModel


@dataclass(frozen=True)
class ParseContext:
    """What a parser may know of the server: the text model (vocabulary, template, FIM tokens)
    and the engine port (the store, for a Responses chain)."""

    text: TextModel
    port: EnginePort


@dataclass(frozen=True)
class Job:
    """One request as the pipeline runs it: what a renderer is built from."""

    req: GenerateRequest
    extra: Any  # what the dialect's parse kept beyond the typed request
    prompt: resolve.Prompt
    params: SamplingParams
    rid: str  # the dialect's id for this response (chatcmpl-..., msg_..., resp_...)
    created: int  # unix seconds
    card: ModelCard
    text: TextModel
    port: EnginePort
    request_id: str  # the HTTP request's id (X-Request-Id, Anthropic's request-id)
    path: str  # the route (errors take the route's dialect shape)


class Renderer(Protocol):
    """Engine events -> one dialect's wire format, for one request."""

    @property
    def thinking(self) -> bool: ...  # the reply is inside a think block now (end_thinking asks)

    # a JSON answer
    def take(self, d: Delta) -> None: ...
    async def body(self) -> dict: ...

    # server-sent events (each returns the bytes to write, b"" for none)
    def start(self, first: Delta | None) -> bytes: ...  # the response just started (first: its first delta)
    def keepalive(self) -> bytes: ...  # nothing to say for a while (queued, prefilling)
    def delta(self, d: Delta) -> bytes: ...
    async def end(self) -> bytes: ...  # the generation ended
    def error(self, message: str, code: str) -> bytes: ...  # it failed after the stream started


class Dialect(Protocol):
    endpoint: str  # the metrics label (chat_completions, messages, ...)
    id_prefix: str  # a response id is this + 24 hex digits
    keepalive: bool  # a stream writes keep-alives while nothing comes
    dry_run: bool  # "dry_run": true answers the capacity estimate instead of running
    fields: frozenset[str]  # every top-level body field it takes (honoured, no-op or refused by it)

    async def parse(self, body: dict, ctx: ParseContext) -> tuple[GenerateRequest, Any]: ...
    def render_prompt(self, req: GenerateRequest, tm: TextModel) -> resolve.Prompt: ...
    def renderer(self, job: Job) -> Renderer: ...
    def headers(self, request: web.Request) -> dict[str, str]: ...  # on every answer, error or not
    def unknown_message(self, name: str) -> str: ...  # --strict-fields' 400 for a field no one defines


class Base:
    """Defaults a dialect takes unless it says otherwise; `renderer` builds its `render_cls`."""

    keepalive = True
    dry_run = False
    render_cls: type = type(None)

    def renderer(self, job: Job) -> Renderer:
        return self.render_cls(job)

    def render_prompt(self, req: GenerateRequest, tm: TextModel) -> resolve.Prompt:
        return resolve.render(req, tm)

    def headers(self, request: web.Request) -> dict[str, str]:
        return {}

    def unknown_message(self, name: str) -> str:
        return f"Unrecognized request argument supplied: {name}"  # OpenAI's words
