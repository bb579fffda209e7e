"""Engine Deltas -> a Response object, or the Responses event stream (Codex, the Agents SDK).

Output items: `reasoning` (a `<think>` block), `message` (output_text),
`function_call` (carrying its namespace when it has one), `custom_tool_call`
(Codex's apply_patch). The stream follows the event contract Codex and the SDK
parse: response.created -> response.in_progress -> per item output_item.added /
content_part.added / deltas / .done events -> response.completed (or .incomplete /
.failed); every event has `type` and an increasing `sequence_number`; item ids
are the same in the stream and in the final object; no [DONE]; a stream never
ends without a terminal event. A finished response is stored (`store: true`)
before its last event or its body goes out (`imp.http.dialects.responses.store`).
"""

from __future__ import annotations

import json
import uuid

import msgspec

from imp.http.dialects.responses import store as stored
from imp.http.dialects.responses.parse import ResponsesExtras
from imp.http.pipeline.dialect import Job
from imp.http.pipeline.reasoning import ThinkSplitter, split_delta
from imp.http.pipeline.spec_usage import SpecTally
from imp.messages import Delta, FinishReason
from imp.tools import ArgsDelta, CallEnd, CallStart, Text

_enc = msgspec.json.Encoder()


def _hex() -> str:
    return uuid.uuid4().hex[:24]


class _Out:
    """The response being built: its items (in output order) and figures; one per request."""

    def __init__(self, rid: str, model: str, ex: ResponsesExtras, created: int):
        self.rid, self.model, self.ex, self.created = rid, model, ex, created
        self.items: list[dict] = []
        self.status = "in_progress"
        self.error = None
        self.incomplete = None
        self.usage = None

    def obj(self) -> dict:
        ex = self.ex
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": self.status,
            "background": False, "error": self.error, "incomplete_details": self.incomplete,
            "instructions": ex.instructions, "max_output_tokens": ex.max_output_tokens, "model": self.model,
            "output": self.items, "parallel_tool_calls": ex.parallel_tool_calls,
            "previous_response_id": ex.previous_response_id,
            "reasoning": {"effort": (ex.reasoning or {}).get("effort"), "summary": (ex.reasoning or {}).get("summary")},
            "service_tier": "default", "store": ex.store, "temperature": ex.temperature,
            "text": {"format": ex.text_format or {"type": "text"}}, "tool_choice": ex.tool_choice_json,
            "tools": ex.tools_json, "top_p": ex.top_p, "truncation": "disabled", "usage": self.usage,
            "user": ex.user, "metadata": ex.metadata,
        }


def _usage(prompt: int, completion: int, cached: int, reasoning: int, spec: dict | None = None) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning, **(spec or {})},
            "total_tokens": prompt + completion}


def _call_item(ex: ResponsesExtras, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    """A parsed call as its item: custom tools come back as custom_tool_call with their raw input."""
    if name in ex.custom:
        try:
            inp = json.loads(arguments or "{}").get("input", "")
        except (ValueError, AttributeError):
            inp = arguments
        item = {"type": "custom_tool_call", "id": f"ctc_{_hex()}", "call_id": call_id, "name": name,
                "input": inp if isinstance(inp, str) else json.dumps(inp), "status": status}
    else:
        item = {"type": "function_call", "id": f"fc_{_hex()}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}
    ns = ex.namespaces.get(name)
    if ns:
        item["namespace"] = ns
    return item


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """status in_progress: the streamed item as added (no content yet); completed / incomplete:
    its text."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


class _Events:
    """Event encoder: every event gets `type` and the next sequence_number."""

    def __init__(self):
        self.seq = 0

    def __call__(self, typ: str, **fields) -> bytes:
        data = {"type": typ, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {typ}\ndata: ".encode() + _enc.encode(data) + b"\n\n"


class ResponsesRenderer:
    """One generation's state as its deltas arrive (the think split, the text, the calls), and
    the response being built from it."""

    def __init__(self, job: Job):
        ex: ResponsesExtras = job.extra
        self.job, self.ex = job, ex
        self.out = _Out(job.rid, job.card.name, ex, job.created)
        self.splitter = ThinkSplitter(job.prompt.opens_think)
        plan = job.req.tool_plan
        self.plan = plan if plan is not None and (plan.active or ex.forced_custom) else None
        self.parser = self.plan.stream_parser() if self.plan is not None and not ex.forced_custom else None
        self.prompt_len = len(job.prompt.ids)
        self.reasoning, self.text = "", ""
        self.completion = self.cached = self.reasoning_tokens = 0
        self.spec = SpecTally()
        self.finish = FinishReason.NONE
        # the stream's state
        self.ev = _Events()
        self.buf: list[bytes] = []
        self.cur: dict = {}  # the item being written: {"kind", "item", "index"}
        self.calls: dict[int, dict] = {}  # parser call index -> its item and output index

    @property
    def thinking(self) -> bool:
        return self.splitter.thinking

    @property
    def cut(self) -> bool:
        return self.finish in (FinishReason.LENGTH, FinishReason.TIMEOUT)

    def _take(self, d: Delta) -> tuple[str, str]:
        r, c = split_delta(self.splitter, d)
        self.prompt_len = d.prompt_tokens or self.prompt_len
        self.cached, self.completion = d.cached_tokens or self.cached, d.completion_tokens
        self.spec.take(d)
        if r and not c:
            self.reasoning_tokens += len(d.token_ids)
        self.reasoning += r
        self.text += c
        if d.finish != FinishReason.NONE:
            self.finish = d.finish
        return r, c

    async def _close(self) -> None:
        """Status and usage once the generation ended; then the store."""
        o = self.out
        o.usage = _usage(self.prompt_len, self.completion, self.cached, self.reasoning_tokens, self.spec.fields())
        if self.cut:
            o.status, o.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            o.status = "completed"
        await stored.put(self.job.port.store, o)

    # ------------------------------------------------------------------ one JSON body

    def take(self, d: Delta) -> None:
        self._take(d)

    async def body(self) -> dict:
        out, ex = self.out, self.ex
        if self.splitter.saw_think:
            out.items.append({"type": "reasoning", "id": f"rs_{_hex()}", "summary": [],
                              "content": [{"type": "reasoning_text", "text": self.reasoning}],
                              "encrypted_content": None})
        if ex.forced_custom:
            out.items.append(_call_item(ex, f"call_{_hex()}", ex.forced_custom, json.dumps({"input": self.text}),
                                        "incomplete" if self.cut else "completed"))
        else:
            text, calls = self.text, ()
            if self.plan is not None:
                parsed = self.plan.parse(self.text, cut=self.cut)
                text, calls = parsed.content, parsed.calls
            if text or not calls:
                # a reply max_output_tokens cut is an incomplete message, as OpenAI marks it
                out.items.append(_message_item(f"msg_{_hex()}", text, "incomplete" if self.cut else "completed"))
            # a custom call max_output_tokens cut is incomplete, as a cut message is
            out.items += [_call_item(ex, c.id, c.name, c.arguments, "incomplete" if self.cut and c is calls[-1]
                                     and c.name in ex.custom else "completed") for c in calls]
        await self._close()
        return out.obj()

    # ------------------------------------------------------------------ server-sent events

    def _flush(self) -> bytes:
        b = b"".join(self.buf)
        self.buf.clear()
        return b

    def _open_item(self, kind: str, item: dict) -> int:
        self._close_item()
        out, ev = self.out, self.ev
        out.items.append(item)
        idx = len(out.items) - 1
        self.buf.append(ev("response.output_item.added", output_index=idx, item=dict(item)))
        self.cur.update(kind=kind, item=item, index=idx)
        if kind == "message":
            self.buf.append(ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return idx

    def _close_item(self) -> None:
        cur, ev, buf = self.cur, self.ev, self.buf
        if not cur:
            return
        item, idx, kind = cur["item"], cur["index"], cur["kind"]
        if kind == "reasoning":
            text = item["content"][0]["text"]
            buf.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                          text=text))
        elif kind == "message":
            text = item.pop("_text", "")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            buf.append(ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                          text=text, logprobs=[]))
            buf.append(ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                          part=part))
            item["content"], item["status"] = [part], "incomplete" if self.cut else "completed"
        elif kind == "custom":
            buf.append(ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                          input=item["input"]))
            item["status"] = "incomplete" if self.cut else "completed"
        buf.append(ev("response.output_item.done", output_index=idx, item=dict(item)))
        cur.clear()

    def _reasoning(self, r: str) -> None:
        if self.cur.get("kind") != "reasoning":
            self._open_item("reasoning", {"type": "reasoning", "id": f"rs_{_hex()}", "summary": [],
                                          "content": [{"type": "reasoning_text", "text": ""}],
                                          "encrypted_content": None})
        item = self.cur["item"]
        item["content"][0]["text"] += r
        self.buf.append(self.ev("response.reasoning_text.delta", item_id=item["id"], output_index=self.cur["index"],
                                content_index=0, delta=r))

    def _text(self, c: str) -> None:
        if not c:
            return
        ex, cur, ev = self.ex, self.cur, self.ev
        if ex.forced_custom:
            if cur.get("kind") != "custom":
                self._open_item("custom", _call_item(ex, f"call_{_hex()}", ex.forced_custom, '{"input": ""}',
                                                     "in_progress"))
            item = cur["item"]
            item["input"] += c
            self.buf.append(ev("response.custom_tool_call_input.delta", item_id=item["id"],
                               output_index=cur["index"], delta=c))
            return
        if cur.get("kind") != "message":
            self._open_item("message", _message_item(f"msg_{_hex()}", "", "in_progress"))
        item = cur["item"]
        item["_text"] = item.get("_text", "") + c
        self.buf.append(ev("response.output_text.delta", item_id=item["id"], output_index=cur["index"],
                           content_index=0, delta=c, logprobs=[]))

    def _tool_events(self, events) -> None:
        ex, ev, buf, calls = self.ex, self.ev, self.buf, self.calls
        for e in events:
            if isinstance(e, Text):
                self._text(e.text)
            elif isinstance(e, CallStart):
                item = _call_item(ex, e.id, e.name, "", "in_progress")
                if item["type"] == "custom_tool_call":
                    item["input"] = ""
                idx = self._open_item("call", item)
                calls[e.index] = {"item": item, "index": idx, "args": "", "raw": e.custom}
            elif isinstance(e, ArgsDelta):
                c = calls[e.index]
                c["args"] += e.text
                if c["item"]["type"] == "function_call":
                    buf.append(ev("response.function_call_arguments.delta", item_id=c["item"]["id"],
                                  output_index=c["index"], delta=e.text))
                elif c["raw"]:  # a custom tool's raw input streams as it comes
                    buf.append(ev("response.custom_tool_call_input.delta", item_id=c["item"]["id"],
                                  output_index=c["index"], delta=e.text))
            elif isinstance(e, CallEnd):
                c = calls[e.index]
                item, idx = c["item"], c["index"]
                if item["type"] == "function_call":
                    item["arguments"] = c["args"]
                    buf.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  arguments=c["args"]))
                elif c["raw"]:  # its deltas already went out
                    item["input"] = c["args"]
                    buf.append(ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                  input=item["input"]))
                else:  # a custom tool called in JSON (a function-shaped history): its input whole once it closes
                    item["input"] = _call_item(ex, "", item["name"], c["args"])["input"]
                    buf.append(ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                  delta=item["input"]))
                    buf.append(ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                  input=item["input"]))
                item["status"] = "incomplete" if self.cut and c["raw"] else "completed"
                buf.append(ev("response.output_item.done", output_index=idx, item=dict(item)))
                self.cur.clear()

    def start(self, first: Delta | None) -> bytes:
        # created, then in_progress: here for a delta start, from keepalive() for a silent one
        obj = self.out.obj()
        return self.ev("response.created", response=obj) + \
            (self.ev("response.in_progress", response=obj) if first is not None else b"")

    def keepalive(self) -> bytes:
        # in_progress every few seconds while queued or prefilling (Codex hangs up after 300 s)
        return self.ev("response.in_progress", response=self.out.obj())

    def delta(self, d: Delta) -> bytes:
        r, c = self._take(d)
        if r:
            self._reasoning(r)
        if self.parser is not None:
            done = d.finish != FinishReason.NONE
            self._tool_events(self.parser.push(c) + (self.plan.finish(self.parser, self.cut) if done else []))
        else:
            self._text(c)
        return self._flush()

    async def end(self) -> bytes:
        self._close_item()
        if not self.out.items:
            self._open_item("message", _message_item(f"msg_{_hex()}", "", "in_progress"))
            self._close_item()
        await self._close()
        terminal = "response.completed" if self.out.status == "completed" else "response.incomplete"
        self.buf.append(self.ev(terminal, response=self.out.obj()))
        return self._flush()

    def error(self, message: str, code: str) -> bytes:
        self.out.status, self.out.error = "failed", {"code": code, "message": message}
        self.buf.clear()
        return self.ev("response.failed", response=self.out.obj())
