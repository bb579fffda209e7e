"""The Anthropic Messages body -> the typed request.

The request's blocks become template messages (tool_use -> the assistant's
tool_calls, tool_result -> a tool message); a `system` message inside `messages`
is a system turn there. A trailing assistant turn with text is a prefill: the
reply continues it.
"""

from __future__ import annotations

import json
import logging

import msgspec

from imp.http.errors import ApiError, bad
from imp.http.pipeline import fields as B
from imp.http.pipeline import resolve, structured, tool_use
from imp.http.pipeline.content import Parts, text_of
from imp.http.pipeline.request import GenerateRequest, Message, Sampling
from imp.tools import ToolSpecError, from_anthropic

_MEDIA = frozenset({"image", "document"})
_PARTS = Parts(text=frozenset({"text"}), media=_MEDIA, joiner="\n\n")
_THINKING = {"enabled", "disabled", "adaptive"}
log = logging.getLogger("imp.http")


def _text(v, where: str) -> str:
    """A string, or an array of text blocks (system, tool_result content)."""
    if not isinstance(v, (str, list)):
        raise bad(f"'{where}' must be a string or an array of text blocks", where)
    return text_of(v, where, _PARTS)


def _blocks(m: dict, where: str, names: dict[str, str]) -> list[dict]:
    """One Anthropic message -> template messages (a user turn may carry tool results).
    A `system` message inside `messages` (Claude Code's mid-conversation system beta) is a
    system turn at that point of the conversation."""
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise bad(f"'{where}.role' must be 'user', 'assistant' or 'system'", f"{where}.role")
    content = m.get("content")
    if content is None:
        raise bad(f"'{where}.content' is required", f"{where}.content")
    if role == "system":
        return [{"role": "system", "content": _text(content, f"{where}.content")}]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"'{where}.content' must be a string or an array of content blocks", f"{where}.content")
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, b in enumerate(content):
        bw = f"{where}.content[{j}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"'{bw}' must be an object with a 'type'", bw)
        t = b["type"]
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise bad(f"'{bw}.text' must be a string", bw)
            texts.append(b["text"])
        elif t in _MEDIA:
            raise bad(f"'{bw}': this model is text-only and cannot take '{t}' content", bw)
        elif t == "tool_use":
            if role != "assistant":
                raise bad(f"'{bw}': tool_use blocks belong in assistant turns", bw)
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad(f"'{bw}' needs a string 'id' and 'name'", bw)
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise bad(f"'{bw}.input' must be an object", bw)
            names[b["id"]] = b["name"]
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        elif t == "tool_result":
            if role != "user":
                raise bad(f"'{bw}': tool_result blocks belong in user turns", bw)
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                raise bad(f"'{bw}.tool_use_id' must be a string", bw)
            err = b.get("is_error")
            if err is not None and not isinstance(err, bool):
                raise bad(f"'{bw}.is_error' must be a boolean", bw)
            out = "" if b.get("content") is None else _text(b["content"], f"{bw}.content")
            msg = {"role": "tool", "tool_call_id": tid, "content": f"Error: {out}" if err else out}
            if tid in names:
                msg["name"] = names[tid]
            results.append(msg)
        elif t in ("thinking", "redacted_thinking"):
            if role != "assistant":
                raise bad(f"'{bw}': {t} blocks belong in assistant turns", bw)
            # earlier turns' thinking is not shown to the model again (Anthropic does the same)
        else:
            raise bad(f"'{bw}': unknown content block type '{t}'", bw)
    out = results
    if role == "assistant":
        msg = {"role": "assistant", "content": "\n\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool_plan(body: dict, template_source: str, messages=()):
    """tools / tool_choice -> the request's ToolPlan (None without tools). Server tools
    (web_search, bash, ...: a `type` other than custom) run on Anthropic's side and are left
    out; cache_control on a tool marks the tools as a cache breakpoint (cache_breakpoint)."""
    try:
        specs, choice = from_anthropic(body.get("tools"), body.get("tool_choice"))
    except ToolSpecError as exc:
        raise bad(exc.message, exc.param) from None
    return tool_use.plan(specs, choice, template_source, messages)


_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # Claude Code's --effort offers all five


def _template_kwargs(body: dict) -> dict:
    """thinking (enabled / adaptive / disabled, budget_tokens) and output_config.effort:
    templates that think (Qwen3 ...) follow enable_thinking; a model that does not think
    simply does not open a think block."""
    kw = {}
    th = body.get("thinking")
    if th is not None:
        if not isinstance(th, dict) or th.get("type") not in _THINKING:
            raise bad(f"'thinking' must be an object with 'type' one of {sorted(_THINKING)}", "thinking")
        if th.get("budget_tokens") is not None:
            B.num(th, "budget_tokens", 1, integer=True, where="thinking.budget_tokens")
        kw["enable_thinking"] = th["type"] != "disabled"
    oc = body.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise bad("'output_config' must be an object", "output_config")
        effort = oc.get("effort")
        if effort is not None and effort not in _EFFORTS:
            raise bad(f"'output_config.effort' must be one of {', '.join(_EFFORTS)}", "output_config.effort")
        if effort is not None:  # to the template as the Responses dialect passes reasoning.effort
            kw["reasoning_effort"] = effort
    cm = body.get("context_management")
    if cm is not None and not isinstance(cm, dict):
        raise bad("'context_management' must be an object", "context_management")
    # context_management edits (clear_thinking, clear_tool_uses) shrink a long conversation on
    # Anthropic's side; here earlier thinking is never shown again anyway and the prompt is
    # the client's to size: accepted, with no edit applied (documented in FEATURES.md)
    return kw


def _messages(body: dict) -> list[dict]:
    """system + messages -> template message dicts (consecutive same-role turns joined)."""
    msgs: list[dict] = []
    if body.get("system") is not None:
        system = _text(body["system"], "system")
        if system:
            msgs.append({"role": "system", "content": system})
    raw = body.get("messages")
    if raw is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object", f"messages[{i}]")
        for msg in _blocks(m, f"messages[{i}]", names):
            prev = msgs[-1] if msgs else None
            # consecutive turns of one role join, as Anthropic does
            if prev and prev["role"] == msg["role"] == "user":
                prev["content"] = "\n\n".join(c for c in (prev["content"], msg["content"]) if c)
            elif prev and prev["role"] == msg["role"] == "assistant":
                prev["content"] = "\n\n".join(c for c in (prev["content"], msg["content"]) if c)
                if msg.get("tool_calls"):
                    prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
            else:
                msgs.append(msg)
    return msgs


# the scalar fields and their ranges (Anthropic's: temperature 0..1, top_k >= 0), imp's own
# sampling and scheduling fields beside them, read in one pass
FIELDS = {
    "max_tokens": B.Num(1, integer=True),
    "temperature": B.Num(0, 1),
    "top_p": B.Num(0, 1, lo_open=True),
    "top_k": B.Num(0, integer=True),
    "min_p": B.Num(0, 1),
    "repetition_penalty": B.Num(0, lo_open=True),
    "seed": B.Num(integer=True),
    "ignore_eos": B.Bool(),
    "speculative": B.Read(B.speculative),
    "stream": B.Bool(),
    **B.SCHEDULING,
}
# Anthropic's hosted features (its MCP connector, its code-execution container) run on its side,
# as its server tools do: left out, with a log line once; routing and billing fields: no effect here
# (prefix caching is automatic, and a block's cache_control bounds the pinned region (cache_breakpoint): a
# top-level cache_control marks nothing more; diagnostics of
# Anthropic's cache have no counterpart; speed: this server runs at one speed, its fastest)
HOSTED = ("mcp_servers", "container")
NO_OPS = ("service_tier", "inference_geo", "cache_control", "diagnostics", "speed", "user_profile_id",
          "workspace_id")
# every top-level field /v1/messages (and count_tokens) takes; the pipeline reports any other
TAKEN = frozenset({"model", "messages", "system", "metadata", "stop_sequences", "tools", "tool_choice", "thinking",
                   "output_config", "context_management", *FIELDS, *structured.FIELDS["anthropic"],
                   *B.TEMPLATE_FIELDS, *HOSTED, *NO_OPS})
_hosted_said: set[str] = set()
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos")


def parse(body: dict, template_source: str = "", *, count_only: bool = False) -> GenerateRequest:
    """A Messages body -> the typed request. A trailing assistant turn with text is a prefill.
    count_only: /v1/messages/count_tokens, whose body has no max_tokens."""
    model = B.model_name(body)
    B.refuse_request_template(body)
    msgs = _messages(body)
    for h in HOSTED:
        if body.get(h) is not None and h not in _hosted_said:
            _hosted_said.add(h)
            log.info("messages: %r runs on Anthropic's side; left out", h)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad("'metadata' must be an object", "metadata")
        if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            raise bad("'metadata.user_id' must be a string", "metadata.user_id")
    last = msgs[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"].strip())
    plan = _tool_plan(body, template_source, [_msg(m) for m in msgs])
    kw = _template_kwargs(body)
    constraint, field = structured.parse(body, dialect="anthropic")
    tool_use.check_compatible(plan, constraint, field)
    if plan is None and "tool_calls" not in template_source:
        msgs = [_calls_as_text(m) for m in msgs]  # the template would drop them silently
    if body.get("max_tokens") is None and not count_only:
        raise bad("'max_tokens' is required", "max_tokens")
    f = B.read(body, FIELDS)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("'stop_sequences' must be an array of strings", "stop_sequences")
        if len(stops) > 16:
            raise bad("'stop_sequences' takes at most 16 strings", "stop_sequences")
    messages = tuple(_msg(m) for m in msgs)
    if plan is not None:
        messages = tool_use.apply_to_messages(plan, messages)
    return GenerateRequest(
        endpoint="messages", model=model, messages=messages, tools=plan.template_tools() if plan else (),
        continue_final_message=prefill, add_generation_prompt=not prefill, template_kwargs=kw,
        constraint=constraint, constraint_field=field, tool_plan=plan,
        sampling=Sampling(**{k: f[k] for k in _SAMPLING}, speculative=f["speculative"][0],
                          mtp_k=f["speculative"][1]), max_tokens=f["max_tokens"],
        stop=tuple(s for s in stops or () if s), stream=f["stream"], priority=f["priority"],
        cache_prompt=f["cache_prompt"], session_id=f["session_id"], lora=f["lora"],
        cache_breakpoint=-2 if count_only else (lambda b: -2 if b is None else b)(cache_breakpoint(body)),
    )


def cache_breakpoint(body: dict) -> int | None:
    """Anthropic's cache_control, per breakpoint: the last marked block bounds the region kept warm. Its
    Anthropic message index (the prefix through that message), -1 for the tools or the system prompt (the
    prefix before the first message), None when nothing is marked. Marks past the last one changes nothing:
    the cache is a prefix, tools then system then messages, as Anthropic orders it."""
    marked = lambda b: isinstance(b, dict) and isinstance(b.get("cache_control"), dict)  # noqa: E731
    last = None
    if any(marked(t) for t in body.get("tools") or () if isinstance(body.get("tools"), list)):
        last = -1
    system = body.get("system")
    if isinstance(system, list) and any(marked(b) for b in system):
        last = -1
    for i, m in enumerate(body.get("messages") or ()):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(marked(b) for b in content):
            last = i
    return last


def _msg(m: dict) -> Message:
    return Message(role=m["role"], content=m["content"], name=m.get("name"),
                   tool_calls=tuple(m["tool_calls"]) if m.get("tool_calls") else None,
                   tool_call_id=m.get("tool_call_id"))


def render_prompt(req: GenerateRequest, tm) -> resolve.Prompt:
    """The prompt; a template that refuses tool turns gets them as plain text (best effort)."""
    try:
        return resolve.render(req, tm)
    except ApiError as err:
        if err.code != "template_error" or not any(m.role == "tool" or m.tool_calls for m in req.messages):
            raise
    # best effort: a template that refuses tool turns gets them as plain text
    text_msgs = _tools_as_text([m.template_dict() for m in req.messages])
    return resolve.render(msgspec.structs.replace(req, messages=tuple(_msg(m) for m in text_msgs)), tm)


def _calls_as_text(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = "\n".join(
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                     ensure_ascii=False) + "\n</tool_call>"
        for c in m["tool_calls"]
    )
    return {"role": m["role"], "content": "\n\n".join(t for t in (m["content"], calls) if t)}


def _tools_as_text(msgs: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in msgs:
        m = _calls_as_text(m)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        if out and out[-1]["role"] == m["role"] and m["role"] != "system":
            out[-1] = dict(out[-1], content=out[-1]["content"] + "\n\n" + m["content"])
        else:
            out.append(m)
    return out
