"""Engine Deltas -> OpenAI chat completions: one `chat.completion`, or `chat.completion.chunk` SSE.

Per choice: a think block goes to `reasoning_content` (and `reasoning`), tool calls
are parsed back from the text into `tool_calls`. A stream's first chunk of each
choice carries the role; with tools, text that may start a call is held back (never
leaks into content) and a call streams as OpenAI's clients expect: its first delta
carries index, id, type, name and arguments "", later ones argument fragments; the
choice finishes with "tool_calls".
"""

from __future__ import annotations

import json

from imp.http.dialects.openai.logprobs import chat_content
from imp.http.pipeline.spec_usage import SpecTally
from imp.http.dialects.openai.wire import KEEPALIVE_COMMENT, error_event, fingerprint, sse_data, usage_json
from imp.http.pipeline.dialect import Job
from imp.http.pipeline.driver import finish_label
from imp.http.pipeline.reasoning import ThinkSplitter, split_delta
from imp.messages import Delta, FinishReason
from imp.tools import ArgsDelta, CallStart, Text


def _tool_calls_json(calls, custom: frozenset[str]) -> list[dict]:
    """OpenAI's tool_calls: a custom tool's call carries its raw input (`type: custom`)."""
    return [{"id": c.id, "type": "custom", "custom": {"name": c.name, "input": json.loads(c.arguments)["input"]}}
            if c.name in custom else
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _finish(label: str, has_calls: bool) -> str:
    # a reply cut by max_tokens stays "length" even when it began a call
    return "tool_calls" if has_calls and label != "length" else label


class ChatRenderer:
    def __init__(self, job: Job):
        req, n = job.req, job.req.n
        self.job, self.req, self.tok = job, req, job.text.tokenizer
        plan = req.tool_plan
        self.tools = plan if plan is not None and plan.active else None  # calls are parsed back
        self.splitters = [ThinkSplitter(job.prompt.opens_think) for _ in range(n)]
        self.texts, self.thoughts = [""] * n, [""] * n
        self.lps: list[list] = [[] for _ in range(n)]
        self.finish = ["stop"] * n
        self.completion = [0] * n
        self.spec = SpecTally()
        self.prompt_tokens, self.cached = len(job.prompt.ids), 0
        self.parsers = [self.tools.stream_parser() for _ in range(n)] if self.tools is not None else None
        self.called = [False] * n
        self.raw: set[tuple[int, int]] = set()  # (choice, call index) of custom tools' calls
        self.base = {"id": job.rid, "object": "chat.completion.chunk", "created": job.created,
                     "model": job.card.name, "system_fingerprint": fingerprint(job.card)}

    @property
    def thinking(self) -> bool:
        return any(s.thinking for s in self.splitters)

    def _count(self, d: Delta) -> None:
        self.completion[d.index] = d.completion_tokens
        self.prompt_tokens, self.cached = d.prompt_tokens or self.prompt_tokens, d.cached_tokens or self.cached
        self.spec.take(d)

    def _usage(self) -> dict:
        return usage_json(self.prompt_tokens, sum(self.completion), self.cached, self.spec.fields())

    # ------------------------------------------------------------------ one JSON body

    def take(self, d: Delta) -> None:
        r, c = split_delta(self.splitters[d.index], d)
        self.thoughts[d.index] += r
        self.texts[d.index] += c
        self.lps[d.index].extend(d.logprobs)
        if d.finish != FinishReason.NONE:
            self.finish[d.index] = finish_label(d.finish)
        self._count(d)

    async def body(self) -> dict:
        req, choices = self.req, []
        for i in range(req.n):
            msg = {"role": "assistant", "content": self.texts[i]}
            fin = self.finish[i]
            if self.tools is not None:
                parsed = self.tools.parse(self.texts[i], cut=fin == "length")
                msg["content"] = parsed.content or None if parsed.calls else parsed.content
                if parsed.calls:
                    msg["tool_calls"] = _tool_calls_json(parsed.calls, self.tools.custom)
                fin = _finish(fin, bool(parsed.calls))
            if self.splitters[i].saw_think:
                msg["reasoning_content"] = msg["reasoning"] = self.thoughts[i]
            choices.append({
                "index": i, "message": msg, "finish_reason": fin,
                "logprobs": {"content": chat_content(self.tok, self.lps[i], req.top_logprobs)} if req.logprobs else None,
            })
        return dict(self.base, object="chat.completion", choices=choices, usage=self._usage())

    # ------------------------------------------------------------------ server-sent events

    def _chunk(self, choices, usage=None) -> bytes:
        c = dict(self.base, choices=choices)
        if self.req.include_usage:
            c["usage"] = usage
        return sse_data(c)

    def _delta_chunk(self, i: int, delta: dict, lp=None) -> bytes:
        return self._chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}])

    def start(self, first: Delta | None) -> bytes:
        return b"".join(self._delta_chunk(i, {"role": "assistant", "content": ""}) for i in range(self.req.n))

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def _tool_chunks(self, i: int, events) -> list[bytes]:
        out = []
        for ev in events:
            if isinstance(ev, Text):
                if ev.text:
                    out.append(self._delta_chunk(i, {"content": ev.text}))
            elif isinstance(ev, CallStart):
                self.called[i] = True
                if ev.custom:  # its raw input streams as custom.input fragments
                    self.raw.add((i, ev.index))
                    call = {"index": ev.index, "id": ev.id, "type": "custom", "custom": {"name": ev.name, "input": ""}}
                else:
                    call = {"index": ev.index, "id": ev.id, "type": "function",
                            "function": {"name": ev.name, "arguments": ""}}
                out.append(self._delta_chunk(i, {"tool_calls": [call]}))
            elif isinstance(ev, ArgsDelta):
                part = {"custom": {"input": ev.text}} if (i, ev.index) in self.raw else \
                    {"function": {"arguments": ev.text}}
                out.append(self._delta_chunk(i, {"tool_calls": [{"index": ev.index, **part}]}))
        return out

    def delta(self, d: Delta) -> bytes:
        i, req = d.index, self.req
        self._count(d)
        done = d.finish != FinishReason.NONE
        r, c = split_delta(self.splitters[i], d)
        lp = {"content": chat_content(self.tok, d.logprobs, req.top_logprobs)} if req.logprobs else None
        out: list[bytes] = []
        if r:
            out.append(self._delta_chunk(i, {"reasoning_content": r, "reasoning": r}, lp if not c else None))
        if self.parsers is not None:
            cut = d.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)
            p = self.parsers[i]
            out += self._tool_chunks(i, p.push(c) + (self.tools.finish(p, cut) if done else []))
            if lp is not None and not r and d.logprobs:  # logprobs of held-back text still go out
                out.append(self._delta_chunk(i, {}, lp))
        elif c or (not r and d.logprobs):
            out.append(self._delta_chunk(i, {"content": c}, lp))
        if done:
            out.append(self._chunk([{"index": i, "delta": {}, "logprobs": None,
                                     "finish_reason": _finish(finish_label(d.finish), self.called[i])}]))
        return b"".join(out)

    async def end(self) -> bytes:
        usage = self._chunk([], self._usage()) if self.req.include_usage else b""
        return usage + b"data: [DONE]\n\n"

    def error(self, message: str, code: str) -> bytes:
        return error_event(message, code)
