"""The OpenAI chat-completions body -> the typed request (every field checked here, once).

Shared by POST /v1/chat/completions and POST /v1/estimate (which parses the
same body and runs nothing). Message content parts are read by
`imp.http.pipeline.content`, as every dialect reads them.
"""

from __future__ import annotations

import json
import logging

import msgspec

from imp.http.dialects.openai import fields as openai_fields
from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline import structured, tool_use
from imp.http.pipeline.content import Parts, text_of
from imp.http.pipeline.request import GenerateRequest, Message
from imp.tools import ToolSpecError, from_openai

log = logging.getLogger("imp.http")

# OpenAI fields that change the output in ways this server cannot give: a 400 naming them,
# never a quiet no-op
_REFUSED = {
    "audio": "audio output is not supported (text-only models)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported (this server runs no moderation model)",
}
# accepted and, by their nature, without effect on a local server (identifiers, billing, storage
# of chat completions for OpenAI's dashboard)
# (prompt caching is automatic here: prompt_cache_options and the retention have nothing to set)
NO_OPS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_retention",
          "prompt_cache_options")

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_PARTS = Parts(text=frozenset({"text", "input_text"}),
               media=frozenset({"image_url", "input_image", "image", "input_audio", "audio", "video", "video_url", "file"}))
# the scalar fields, read in one pass (messages, tools, response_format and the template's
# options have readers of their own above and in imp.http.pipeline)
FIELDS = {**openai_fields.COMMON, **openai_fields.SAMPLING, **openai_fields.LOGPROBS,
          "logit_lens": B.Read(B.logit_lens),  # chat only (the API reference's rows)
          "cfg_scale": B.Num(1, 10, default=1.0), "cfg_negative_prompt": B.Str()}
# every top-level field the chat route takes: honoured, without effect by nature (NO_OPS), or
# refused with its reason (_REFUSED, request templates); the pipeline reports any other
TAKEN = frozenset({
    "model", "messages", "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "reasoning_effort", "verbosity",
    "modalities", "prompt_cache_key", "dry_run", *FIELDS, *_REFUSED, *NO_OPS, *structured.FIELDS["openai"],
    *B.TEMPLATE_FIELDS,
})
# template variables a request's chat_template_kwargs may not override
_RESERVED_KW = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}


def parse_messages(raw) -> tuple[Message, ...]:
    """Validate OpenAI messages; return template-ready dicts (content as text)."""
    if raw is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
        content = m.get("content")
        if content is None:
            if role not in ("assistant",) or not m.get("tool_calls"):
                if role != "assistant":
                    raise bad(f"{where}.content is required", f"{where}.content")
            text = ""
        else:
            text = text_of(content, f"{where}.content", _PARTS)
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise bad(f"{where}.tool_calls must be an array of objects", f"{where}.tool_calls")
        if calls:
            calls = [_as_function(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise bad(f"{where}.{k} must be a string", f"{where}.{k}")
        out.append(Message(role="system" if role == "developer" else role, content=text, name=m.get("name"),
                           tool_calls=tuple(calls) if calls else None, tool_call_id=m.get("tool_call_id")))
    return tuple(out)


def _as_function(call: dict, where: str) -> dict:
    """A custom tool's call in the history (`type: custom`, raw `input`) as the templates and the
    tool layer read calls: function-shaped, its input in `{"input": ...}` arguments."""
    if call.get("type") != "custom":
        return call
    c = call.get("custom")
    if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("input", ""), str):
        raise bad(f"{where}.custom must be an object with string 'name' and 'input'", f"{where}.custom")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps({"input": c.get("input", "")}, ensure_ascii=False)}}


def template_options(body: dict) -> dict:
    """tools, chat_template_kwargs, continue_final_message / add_generation_prompt."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be an array of objects", "tools")
    kw = B.obj(body, "chat_template_kwargs")
    kw = {k: v for k, v in (kw or {}).items() if isinstance(k, str) and k not in _RESERVED_KW}
    cont = B.boolean(body, "continue_final_message")
    add_gen = body.get("add_generation_prompt")
    if add_gen is not None and not isinstance(add_gen, bool):
        raise bad("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    if cont and add_gen:
        raise bad("'continue_final_message' and 'add_generation_prompt': true cannot be combined",
                  "add_generation_prompt")
    return {"tools": tuple(tools or ()), "template_kwargs": kw, "continue_final_message": cont,
            "add_generation_prompt": not cont if add_gen is None else add_gen}


def tools_of(body: dict, template_source: str, messages=()):
    """OpenAI tools / tool_choice / parallel_tool_calls (and the legacy functions /
    function_call spelling) -> the request's ToolPlan, or None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None:  # the pre-tools API: the same thing, older names
        if tools is not None:
            raise bad("'functions' and 'tools' cannot be combined", "functions")
        fns = body["functions"]
        if not isinstance(fns, list):
            raise bad("'functions' must be an array", "functions")
        tools = [{"type": "function", "function": f} for f in fns]
        fc = body.get("function_call")
        choice = {"type": "function", "function": fc} if isinstance(fc, dict) else fc
    try:
        specs, ch = from_openai(tools, choice, body.get("parallel_tool_calls"))
    except ToolSpecError as exc:
        raise bad(exc.message, exc.param) from None
    return tool_use.plan(specs, ch, template_source, messages)


def _cache_key(body: dict) -> str:
    """prompt_cache_key (OpenAI's prefix-cache routing hint) is the prefix-cache affinity key, as
    on /v1/responses; session_id wins when both are sent."""
    pck = B.string(body, "prompt_cache_key", "")
    return pck[:256] if pck and pck.isprintable() else ""


def parse(body: dict, vocab_size: int, template_source: str = "") -> GenerateRequest:
    """A chat-completions body -> the typed request (every field checked here, once)."""
    B.refuse_request_template(body)
    model = B.model_name(body)
    for k, why in _REFUSED.items():
        if body.get(k) is not None:
            raise bad(f"'{k}': {why}", k, "unsupported_parameter")
    mods = body.get("modalities")
    if mods is not None and (not isinstance(mods, list) or any(m != "text" for m in mods)):
        raise bad("'modalities': only [\"text\"] is supported", "modalities", "unsupported_parameter")
    messages = parse_messages(body.get("messages"))
    opts = template_options(body)
    plan = tools_of(body, template_source, messages)
    constraint, field = structured.parse(body, dialect="openai")
    tool_use.check_compatible(plan, constraint, field)
    if plan is not None:
        opts["tools"] = plan.template_tools()
        messages = tool_use.apply_to_messages(plan, messages)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise bad("'reasoning_effort' must be none, minimal, low, medium or high", "reasoning_effort")
        # the templates that think (Qwen3 ...) follow enable_thinking; the effort itself is passed through
        opts["template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal"),
                                   "reasoning_effort": effort, **opts["template_kwargs"]}
    verbosity = body.get("verbosity")
    if verbosity is not None:
        if verbosity not in ("low", "medium", "high"):
            raise bad("'verbosity' must be low, medium or high", "verbosity")
        # to the template, as reasoning_effort: a template that reads it (gpt-oss style) honours it
        opts["template_kwargs"] = {"verbosity": verbosity, **opts["template_kwargs"]}
    if opts["continue_final_message"]:
        last = messages[-1]
        if last.role != "assistant" or last.tool_calls or not last.content.strip():
            raise bad("'continue_final_message' needs the last message to be an assistant turn with text "
                      "and no tool_calls", "messages")
    f = B.read(body, FIELDS)
    c = openai_fields.common_of(f)
    sampling = openai_fields.sampling_of(f, B.logit_bias(body, vocab_size))
    plp = openai_fields.prompt_logprobs(f["prompt_logprobs"], allowed=False, stream=c.stream)
    logprobs, top = f["logprobs"], f["top_logprobs"]
    if top is not None and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if f["logit_lens"]:  # it implies logprobs: the lens rides on each content entry
        logprobs, sampling = True, msgspec.structs.replace(sampling, logit_lens=f["logit_lens"])
    if f["cfg_scale"] != 1.0:
        sampling = msgspec.structs.replace(sampling, cfg_scale=float(f["cfg_scale"]),
                                           cfg_negative_prompt=f["cfg_negative_prompt"])
    return GenerateRequest(
        endpoint="chat_completions", model=model, messages=messages, **opts, sampling=sampling,
        max_tokens=c.max_tokens, n=c.n, stop=c.stop, stream=c.stream, include_usage=c.include_usage,
        logprobs=logprobs, top_logprobs=top or 0, prompt_logprobs=plp, priority=c.priority,
        cache_prompt=c.cache_prompt, session_id=c.session_id or _cache_key(body), lora=c.lora,
        constraint=constraint, constraint_field=field, tool_plan=plan,
    )
