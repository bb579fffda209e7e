"""Engine Deltas -> an Anthropic `message`, or its named SSE events.

The reply comes back as content blocks: `thinking` (a think block), `text`,
`tool_use` (calls parsed back from the text). A stream: message_start, then per
block content_block_start / deltas of the block's own type (thinking_delta,
text_delta, input_json_delta) / content_block_stop, then message_delta with the
stop reason and usage, message_stop; `ping` while nothing comes.
"""

from __future__ import annotations

import json

import msgspec

from imp.http.errors import ApiError, error_body
from imp.http.pipeline.dialect import Job
from imp.http.pipeline.reasoning import ThinkSplitter, split_delta
from imp.http.pipeline.spec_usage import SpecTally
from imp.messages import Delta, FinishReason
from imp.tools import ArgsDelta, CallStart, Text, reprefix


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + msgspec.json.encode(data) + b"\n\n"


_PING = _event("ping", {"type": "ping"})


def _stop(d: Delta | None, called: bool = False) -> tuple[str, str | None]:
    if d is None:
        return "end_turn", None
    if d.finish == FinishReason.STOP and d.stop_str:
        return "stop_sequence", d.stop_str
    if d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return "max_tokens", None
    return ("tool_use" if called else "end_turn"), None


def _usage(prompt: int, completion: int, cached: int, spec: dict | None = None, pin: int = 0) -> dict:
    # Anthropic's three parts of the prompt: read from the cache, written to it (the full blocks of the
    # cache_control region that were not there yet: they are kept warm now; pin comes block-aligned), and the
    # rest, after the last breakpoint or in a block not full
    created = max(0, min(pin, prompt) - cached)
    return {"input_tokens": prompt - cached - created, "output_tokens": completion,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached, **(spec or {})}


def _tool_use_block(call) -> dict:
    return {"type": "tool_use", "id": reprefix(call.id, "toolu_"), "name": call.name,
            "input": json.loads(call.arguments or "{}")}


class AnthropicRenderer:
    def __init__(self, job: Job):
        self.job = job
        plan = job.req.tool_plan
        self.plan = plan if plan is not None and plan.active else None
        self.splitter = ThinkSplitter(job.prompt.opens_think)
        self.prompt_len, self.cached, self.completion = len(job.prompt.ids), 0, 0
        self.spec = SpecTally()
        self.text = self.thought = ""
        self.last: Delta | None = None  # the delta that finished the reply
        # the stream's state: the open block
        self.parser = self.plan.stream_parser() if self.plan is not None else None
        self.index, self.open_kind, self.called = -1, None, False
        self.out: list[bytes] = []

    @property
    def thinking(self) -> bool:
        return self.splitter.thinking

    def _count(self, d: Delta) -> None:
        self.prompt_len, self.cached, self.completion = d.prompt_tokens or self.prompt_len, d.cached_tokens or self.cached, \
            d.completion_tokens
        self.spec.take(d)
        if d.finish != FinishReason.NONE:
            self.last = d

    def _message(self, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.job.rid, "type": "message", "role": "assistant", "model": self.job.card.name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    # ------------------------------------------------------------------ one JSON body

    def take(self, d: Delta) -> None:
        r, c = split_delta(self.splitter, d)
        self.thought, self.text = self.thought + r, self.text + c
        self._count(d)

    async def body(self) -> dict:
        content, text, calls = [], self.text, ()
        if self.splitter.saw_think:
            content.append({"type": "thinking", "thinking": self.thought, "signature": ""})
        if self.plan is not None:
            cut = self.last is not None and self.last.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)
            parsed = self.plan.parse(text, cut=cut)
            text, calls = parsed.content, parsed.calls
        if text or not (content or calls):
            content.append({"type": "text", "text": text})
        content += [_tool_use_block(c) for c in calls]
        return self._message(content, _stop(self.last, bool(calls)), _usage(self.prompt_len, self.completion,
                                                                           self.cached, self.spec.fields(),
                                                                           self._pin()))

    # ------------------------------------------------------------------ server-sent events

    def _flush(self) -> bytes:
        b = b"".join(self.out)
        self.out.clear()
        return b

    def _block(self, kind: str, start: dict | None = None) -> None:
        if self.open_kind == kind and start is None:
            return
        if self.open_kind is not None:
            self.out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.index, self.open_kind = self.index + 1, kind
        if start is None:
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
        self.out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                       "content_block": start}))

    def _delta(self, d: dict) -> None:
        self.out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                       "delta": d}))

    def _text_out(self, c: str) -> None:
        if c:
            self._block("text")
            self._delta({"type": "text_delta", "text": c})

    def _tool_events(self, events) -> None:
        for ev in events:
            if isinstance(ev, Text):
                self._text_out(ev.text)
            elif isinstance(ev, CallStart):
                self.called = True
                self._block("tool_use", {"type": "tool_use", "id": reprefix(ev.id, "toolu_"), "name": ev.name,
                                         "input": {}})
            elif isinstance(ev, ArgsDelta):
                self._delta({"type": "input_json_delta", "partial_json": ev.text})

    def start(self, first: Delta | None) -> bytes:
        # a keep-alive start (queued, prefilling) pings through keepalive(); a delta start pings here
        cached = first.cached_tokens if first is not None else 0
        prompt = (first.prompt_tokens or self.prompt_len) if first is not None else self.prompt_len
        msg = self._message([], (None, None), _usage(prompt, 0, cached))
        return _event("message_start", {"type": "message_start", "message": msg}) + (_PING if first else b"")

    def keepalive(self) -> bytes:
        return _PING

    def _pin(self) -> int:
        """The cache_control region's tokens that the pin holds: its full blocks."""
        bs = self.job.card.block_size
        return self.job.req.pin_tokens // bs * bs

    def delta(self, d: Delta) -> bytes:
        self._count(d)
        r, c = split_delta(self.splitter, d)
        if r or (self.splitter.saw_think and self.open_kind is None and self.index < 0):
            self._block("thinking")
            if r:
                self._delta({"type": "thinking_delta", "thinking": r})
        if self.parser is not None:
            cut = d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)
            done = d.finish != FinishReason.NONE
            self._tool_events(self.parser.push(c) + (self.plan.finish(self.parser, cut) if done else []))
        else:
            self._text_out(c)
        return self._flush()

    async def end(self) -> bytes:
        if self.open_kind is None:
            self._block("text")  # an empty reply is still one (empty) text block, as non-stream
        stop = _stop(self.last, self.called)
        self.out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
                        + _event("message_delta", {"type": "message_delta",
                                                   "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                                   "usage": _usage(self.prompt_len, self.completion, self.cached,
                                                                   self.spec.fields(), self._pin())})
                        + _event("message_stop", {"type": "message_stop"}))
        return self._flush()

    def error(self, message: str, code: str) -> bytes:
        return _event("error", error_body(self.job.path, ApiError(500, message), self.job.request_id))
