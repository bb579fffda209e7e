"""The OpenAI Responses body -> the typed request: input items, tools, text.format, reasoning.

Input: a string (one user message) or items — `message` (roles user / assistant /
system / developer; `input_text` / `output_text` parts), `function_call`,
`function_call_output`, `custom_tool_call`, `custom_tool_call_output`, `reasoning`
(accepted and not shown again, as Anthropic's thinking). Replayed calls join the
assistant message before them: one response, one assistant turn.

Tools: `function`; `custom` (Codex's apply_patch: free text with a Lark or regex
`format`) offered to the model as a function with one `input` string, its grammar
enforced when the call is forced (the whole output then is the input) and returned
as `custom_tool_call`; `namespace` flattened, its calls carrying the namespace;
hosted tools (web_search, file_search, code_interpreter, image_generation,
computer_use_preview, mcp, tool_search, local_shell) run on OpenAI's side: dropped,
with a log line; any other type is a 400.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from imp.http.errors import ApiError, bad
from imp.http.pipeline import fields as B
from imp.http.pipeline import structured, tool_use
from imp.http.pipeline.content import Parts, text_of
from imp.http.pipeline.request import GenerateRequest, Message, Sampling
from imp.messages import Constraint
from imp.tools import Tool, ToolChoice

log = logging.getLogger("imp.http")

HOSTED = {"web_search", "web_search_preview", "web_search_2025_08_26", "file_search", "code_interpreter",
          "image_generation", "computer_use_preview", "computer_use", "mcp", "tool_search", "local_shell"}
_logged: set[str] = set()
_PARTS = Parts(text=frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"}),
               media=frozenset({"input_image", "input_file", "input_audio"}), refusal=True)


@dataclass(frozen=True)
class CustomTool:
    name: str
    namespace: str | None
    grammar: Constraint | None  # its format: lark / regex; None = free text


@dataclass
class ResponsesExtras:
    """What the Responses rendering needs beyond the typed request."""

    store: bool = True
    previous_response_id: str | None = None
    instructions: str | None = None
    metadata: dict = field(default_factory=dict)
    user: str | None = None
    include: tuple[str, ...] = ()
    reasoning: dict | None = None
    text_format: dict | None = None
    tools_json: list = field(default_factory=list)  # the tools as the client sent them (echoed back)
    tool_choice_json: object = "auto"
    parallel_tool_calls: bool = True
    namespaces: dict = field(default_factory=dict)  # flattened tool name -> namespace
    custom: dict = field(default_factory=dict)  # tool name -> CustomTool
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    input_items: list = field(default_factory=list)  # the request's own input, as items (for the store)
    forced_custom: str | None = None  # tool_choice names a custom tool: the whole output is its input


def _text_of(content, where: str) -> str:
    return text_of(content, where, _PARTS)


def normalize_input(raw) -> list[dict]:
    """input as items (a string is one user message)."""
    if raw is None:
        raise bad("'input' is required", "input")
    if isinstance(raw, str):
        if not raw:
            raise bad("'input' is empty", "input")
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a non-empty string or array of items", "input")
    for i, it in enumerate(raw):
        if not isinstance(it, dict):
            raise bad(f"'input[{i}]' must be an object", f"input[{i}]")
    return raw


def items_to_messages(items: list[dict], where: str = "input", custom: dict | None = None) -> list[Message]:
    """Response items -> template messages (calls joined to the assistant turn before them)."""
    out: list[Message] = []
    custom = custom or {}
    calls: list[dict] = []

    def flush_calls():
        nonlocal calls
        if not calls:
            return
        if out and out[-1].role == "assistant" and not out[-1].tool_calls:
            prev = out.pop()
            out.append(Message(role="assistant", content=prev.content, tool_calls=tuple(calls)))
        else:
            out.append(Message(role="assistant", content="", tool_calls=tuple(calls)))
        calls = []

    for i, it in enumerate(items):
        w = f"{where}[{i}]"
        t = it.get("type", "message" if "role" in it else None)
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"'{w}.role' must be user, assistant, system or developer", f"{w}.role")
            flush_calls()
            text = _text_of(it.get("content"), f"{w}.content")
            out.append(Message(role="system" if role == "developer" else role, content=text))
        elif t in ("function_call", "custom_tool_call"):
            name = it.get("name")
            cid = it.get("call_id") or it.get("id")
            if not isinstance(name, str) or not isinstance(cid, str):
                raise bad(f"'{w}' needs string 'name' and 'call_id'", w)
            if t == "function_call":
                args = it.get("arguments", "{}")
                if not isinstance(args, str):
                    raise bad(f"'{w}.arguments' must be a JSON string", f"{w}.arguments")
            else:
                if not isinstance(it.get("input", ""), str):
                    raise bad(f"'{w}.input' must be a string", f"{w}.input")
                args = json.dumps({"input": it.get("input", "")}, ensure_ascii=False)
            calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        elif t in ("function_call_output", "custom_tool_call_output"):
            flush_calls()
            cid = it.get("call_id")
            if not isinstance(cid, str):
                raise bad(f"'{w}.call_id' must be a string", f"{w}.call_id")
            output = it.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, f"{w}.output")
            out.append(Message(role="tool", content=text, tool_call_id=cid))
        elif t == "reasoning":
            continue  # an earlier turn's reasoning is not shown again (encrypted_content is ours to ignore)
        elif t == "item_reference":
            raise bad(f"'{w}': item_reference is not supported; send the item itself", w)
        else:
            raise bad(f"'{w}.type': unknown input item type {t!r}", f"{w}.type")
    flush_calls()
    # the tool messages need their call's name for a generic-shape rendering
    names = {c["id"]: c["function"]["name"] for m in out for c in (m.tool_calls or ())}
    return [Message(role=m.role, content=m.content, tool_call_id=m.tool_call_id, name=names.get(m.tool_call_id))
            if m.role == "tool" else m for m in out]


def _tools(raw, extras: ResponsesExtras) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad("'tools' must be an array", "tools")
    out: list[Tool] = []

    def add(t: dict, w: str, namespace: str | None):
        typ = t.get("type")
        if typ == "function":
            name = t.get("name")
            if not isinstance(name, str) or not name:
                raise bad(f"'{w}.name' must be a non-empty string", f"{w}.name")
            params = t.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise bad(f"'{w}.parameters' must be an object", f"{w}.parameters")
            desc = t.get("description") or ""
            out.append(Tool(name, desc if isinstance(desc, str) else "", params, bool(t.get("strict"))))
            if namespace:
                extras.namespaces[name] = namespace
        elif typ == "custom":
            name = t.get("name")
            if not isinstance(name, str) or not name:
                raise bad(f"'{w}.name' must be a non-empty string", f"{w}.name")
            fmt = t.get("format") or {"type": "text"}
            grammar = None
            desc = t.get("description") or ""
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                syntax, definition = fmt.get("syntax"), fmt.get("definition")
                if syntax not in ("lark", "regex") or not isinstance(definition, str) or not definition:
                    raise bad(f"'{w}.format' must be a grammar with syntax lark or regex and a definition",
                              f"{w}.format")
                grammar = Constraint(syntax, definition)
            elif not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise bad(f"'{w}.format.type' must be text or grammar", f"{w}.format")
            extras.custom[name] = CustomTool(name, namespace, grammar)
            if namespace:
                extras.namespaces[name] = namespace
            # a raw-text tool: its calls are raw blocks held to its grammar (imp.tools.custom)
            out.append(Tool(name, desc if isinstance(desc, str) else "", custom=True,
                            grammar=(grammar.kind, grammar.source) if grammar is not None else None))
        elif typ == "namespace":
            ns = t.get("name")
            inner = t.get("tools")
            if not isinstance(ns, str) or not isinstance(inner, list):
                raise bad(f"'{w}' (namespace) needs a string 'name' and a 'tools' array", w)
            for j, sub in enumerate(inner):
                if not isinstance(sub, dict):
                    raise bad(f"'{w}.tools[{j}]' must be an object", f"{w}.tools[{j}]")
                add(sub, f"{w}.tools[{j}]", ns)
        elif typ in HOSTED:
            if typ not in _logged:
                _logged.add(typ)
                log.info("responses: hosted tool %r runs on OpenAI's side; dropped", typ)
        else:
            raise bad(f"'{w}.type': tool type {typ!r} is not supported (function, custom, namespace; hosted "
                      "tools are dropped)", f"{w}.type")

    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise bad(f"'tools[{i}]' must be an object", f"tools[{i}]")
        add(t, f"tools[{i}]", None)
    names = [t.name for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise bad(f"tool name {dup!r} is given twice", "tools")
    return out


def _choice(raw, tools: list[Tool], parallel: bool) -> ToolChoice:
    if raw is None or raw == "auto":
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if raw in ("none", "required"):
        if raw == "required" and not tools:
            raise bad("'tool_choice' is 'required' but no tools are given", "tool_choice")
        return ToolChoice(raw, parallel=parallel)
    if isinstance(raw, dict) and raw.get("type") in ("function", "custom") and isinstance(raw.get("name"), str):
        if raw["name"] not in {t.name for t in tools}:
            raise bad(f"'tool_choice.name': no tool named {raw['name']!r} is given", "tool_choice.name")
        return ToolChoice("named", raw["name"], parallel=parallel)
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        mode = raw.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad("'tool_choice.mode' must be auto or required", "tool_choice.mode")
        return ToolChoice(mode if tools else "none", parallel=parallel)
    raise bad("'tool_choice' must be auto, none, required or {\"type\": \"function\"|\"custom\", \"name\"}",
              "tool_choice")


# Responses fields imp knows and cannot honour: set to anything but their default they are a 400
# naming the field, never a quiet no-op (a client asking for background mode would otherwise
# wait on an answer it believes is queued elsewhere).
_REFUSED = {
    "background": (lambda v: v in (None, False), "background mode is not supported; send the request and wait"),
    "conversation": (lambda v: v is None, "the Conversations API is not supported; use previous_response_id"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported; send the input itself"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is supported (a prompt "
                   "beyond the context is a 400)"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported on /v1/responses; use "
                     "/v1/chat/completions"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported; use parallel_tool_calls"),
    "moderation": (lambda v: v is None, "moderation is not supported (this server runs no moderation model)"),
}


# identifiers, routing, billing and stream obfuscation (Codex's client_metadata among them): no
# effect on a local server
# effect on a local server; prompt caching is automatic (prompt_cache_options); compaction
# (context_management) and image options have nothing to act on here; background_options only
# matter with background, which is refused
NO_OPS = ("client_metadata", "safety_identifier", "service_tier", "stream_options", "prompt_cache_retention",
          "prompt_cache_options", "access_programs", "background_options", "context_management", "image")
# every top-level field /v1/responses takes; the pipeline reports any other
TAKEN = frozenset({
    "model", "input", "instructions", "store", "previous_response_id", "metadata", "user", "include",
    "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "tools",
    "parallel_tool_calls", "tool_choice", "reasoning", "continue_final_message", "prompt_cache_key", "stream",
    "priority", "cache_prompt", "session_id", "lora", "speculative", *structured.FIELDS["responses"], *_REFUSED,
    *B.TEMPLATE_FIELDS, *NO_OPS,
})


def _refuse_unsupported(body: dict) -> None:
    for name, (ok, why) in _REFUSED.items():
        if not ok(body.get(name)):
            raise bad(f"'{name}': {why}", name)


def parse(body: dict, vocab_size: int, template_source: str = "",
          history: list[Message] | None = None) -> tuple[GenerateRequest, ResponsesExtras]:
    """history: the previous_response_id chain's conversation (the store's), prepended."""
    B.refuse_request_template(body)
    _refuse_unsupported(body)
    model = B.model_name(body)
    ex = ResponsesExtras()
    ex.store = B.boolean(body, "store", True)
    ex.previous_response_id = B.string(body, "previous_response_id")
    ex.instructions = B.string(body, "instructions")
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise bad("'metadata' must be an object", "metadata")
    ex.metadata = md or {}
    ex.user = B.string(body, "user")
    inc = body.get("include")
    if inc is not None and (not isinstance(inc, list) or not all(isinstance(x, str) for x in inc)):
        raise bad("'include' must be an array of strings", "include")
    ex.include = tuple(inc or ())
    ex.max_output_tokens = B.num(body, "max_output_tokens", 1, integer=True)
    ex.temperature = B.num(body, "temperature", 0, 2)
    ex.top_p = B.num(body, "top_p", 0, 1, lo_open=True)
    items = normalize_input(body.get("input"))
    ex.input_items = items
    tools = _tools(body.get("tools"), ex)
    ex.tools_json = body.get("tools") or []
    # unset: one call per turn (llama.cpp's default; see imp.tools.spec._parallel); echoed as sent
    ex.parallel_tool_calls = B.boolean(body, "parallel_tool_calls", False)
    choice = _choice(body.get("tool_choice"), tools, ex.parallel_tool_calls)
    ex.tool_choice_json = body.get("tool_choice", "auto")
    reasoning = B.obj(body, "reasoning")
    ex.reasoning = reasoning
    kw: dict = {}
    if reasoning is not None:
        effort = reasoning.get("effort")
        if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
            raise bad("'reasoning.effort' must be none, minimal, low, medium, high or xhigh", "reasoning.effort")
        if effort is not None:
            kw = {"enable_thinking": effort not in ("none", "minimal"), "reasoning_effort": effort}
    text = B.obj(body, "text")
    ex.text_format = (text or {}).get("format")
    constraint, cfield = structured.parse(body, dialect="responses")
    msgs: list[Message] = []
    if ex.instructions:
        msgs.append(Message(role="system", content=ex.instructions))
    msgs += history or []
    msgs += items_to_messages(items, custom=ex.custom)
    if not msgs:
        raise bad("'input' holds no message", "input")
    messages = tuple(msgs)
    if choice.mode == "named" and choice.name in ex.custom:
        # a forced custom tool (Codex's apply_patch): the whole output is its input, under its own
        # grammar; earlier turns are shown in the generic shape, the tool's instructions as a system note
        ex.forced_custom = choice.name
        shown = tool_use.plan(tools, ToolChoice("none"), template_source)
        messages = tool_use.apply_to_messages(shown, messages)
        tool = next(t for t in tools if t.name == choice.name)
        note = f"Reply with only the input of the `{tool.name}` tool, nothing else. {tool.description}".strip()
        if tool.grammar is not None:
            note += f"\n\nThe input must follow this {tool.grammar[0]} grammar:\n{tool.grammar[1]}"
        messages = (Message(role="system", content=note), *messages) if messages[0].role != "system" else \
            (Message(role="system", content=messages[0].content + "\n\n" + note), *messages[1:])
        g = ex.custom[choice.name].grammar
        plan = tool_use.ToolPlan(tuple(tools), choice, "generic", False, g)
    else:
        plan = tool_use.plan(tools, choice, template_source, messages)
        if plan is not None:
            messages = tool_use.apply_to_messages(plan, messages)
    tool_use.check_compatible(plan, constraint, cfield)
    cont = B.boolean(body, "continue_final_message")
    if cont and (messages[-1].role != "assistant" or not messages[-1].content.strip()):
        raise bad("'continue_final_message' needs the last input item to be an assistant message with text",
                  "input")
    sid = B.session_id(body)
    spec = B.speculative(body)
    pck = B.string(body, "prompt_cache_key", "")
    return GenerateRequest(
        endpoint="responses", model=model, messages=messages, prompt_param="input",
        tools=plan.template_tools() if plan is not None else (), continue_final_message=cont,
        add_generation_prompt=not cont, template_kwargs=kw,
        sampling=Sampling(temperature=ex.temperature, top_p=ex.top_p, top_k=B.num(body, "top_k", -1, integer=True),
                          min_p=B.num(body, "min_p", 0, 1), seed=B.num(body, "seed", integer=True),
                          repetition_penalty=B.num(body, "repetition_penalty", 0, lo_open=True),
                          speculative=spec[0], mtp_k=spec[1]),
        max_tokens=ex.max_output_tokens, stream=B.boolean(body, "stream"),
        priority=B.num(body, "priority", -(2**31), 2**31 - 1, integer=True, default=0),
        cache_prompt=B.boolean(body, "cache_prompt"),
        # prompt_cache_key (Codex sends one per conversation) is the prefix-cache affinity key
        session_id=sid or (pck[:256] if pck and pck.isprintable() else ""),
        constraint=constraint, constraint_field=cfield, lora=B.lora_name(body),
        tool_plan=plan,
    ), ex


async def history(store, prev: str | None) -> list[Message]:
    """The conversation behind previous_response_id, as template messages (oldest first)."""
    if not prev:
        return []
    if store is None:
        raise bad("'previous_response_id' needs the responses store, which this server runs without",
                  "previous_response_id")
    reply = await store.chain(prev)
    if not reply.ok:
        if reply.status == 404:
            raise ApiError(400, f"Previous response with id '{prev[:128]}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        raise ApiError(503 if reply.status == 503 else 500, f"responses store: {reply.error}",
                       code="store_unavailable")
    if reply.missing:
        raise ApiError(400, f"Previous response with id '{reply.missing[:128]}' (in the chain of '{prev[:128]}') "
                            "is no longer stored.", param="previous_response_id", code="previous_response_not_found")
    items: list[dict] = []
    for link in reply.chain:
        items += [json.loads(i.json) for i in link.input_items]
        items += [it for it in json.loads(link.response_json).get("output", []) if it.get("type") != "reasoning"]
    return items_to_messages(items, where="previous_response_id")
