"""Chat templates: the GGUF's jinja template rendered with HF semantics.

Same environment as transformers' `apply_chat_template` (sandboxed,
trim_blocks, lstrip_blocks, loopcontrols, `tojson`, `raise_exception`,
`strftime_now`), so a template behaves here as on the Hub. The sandbox is
immutable: a template (ours, or an operator's --chat-template file) cannot
reach Python internals or mutate the values it is given.

Special tokens come only from the template's own text. `render_and_encode`
renders once with every message content replaced by a unique sentinel, cuts
the result at the sentinels, and lets the tokenizer recognise control
tokens only in the template's parts; the user's `<|im_start|>` stays text.
"""

from __future__ import annotations

import datetime
import json
import secrets
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# Used when the GGUF has no template (transformers' old default).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Used instead when the vocabulary is Gemma's (its turn markers, not ChatML's,
# are the control tokens there); the role "assistant" is Gemma's "model".
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def fold_system(messages: list[dict]) -> list[dict]:
    """System turns folded into a user turn, for templates with no system role (Gemma's has
    none: its official template prefixes the first user turn with the system text). A system
    message goes in front of the next user turn's text, or, when an assistant turn or the end
    comes first, in front of the previous user turn's: Claude Code sends its agent list as a
    system message *after* the user's request, and rendered as a turn of its own it is the last
    thing the model reads before answering."""
    out: list[dict] = []
    before: dict[int, list[str]] = {}  # user turn (index in out) -> system texts put in front, in order
    pending: list[str] = []
    last_user = None  # index in out of the user turn since the last assistant turn

    def fold_into(i: int) -> None:
        before.setdefault(i, []).extend(pending)
        pending.clear()

    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role == "system" and isinstance(content, str):
            if content:
                pending.append(content)
            continue
        if pending and role != "user" and last_user is not None:
            fold_into(last_user)
        out.append(m)
        if role == "user":
            last_user = len(out) - 1
            if pending:
                fold_into(last_user)
        elif role == "assistant":
            last_user = None
    if pending:
        if last_user is not None:
            fold_into(last_user)
        else:
            out.append({"role": "user", "content": ""})
            fold_into(len(out) - 1)
    for i, texts in before.items():
        own = out[i].get("content") or ""
        out[i] = dict(out[i], content="\n\n".join([*texts, own] if own else texts))
    return out


class TemplateError(ValueError):
    """The template refused the request (raise_exception) or failed on it.
    The HTTP layer answers 400 with this message."""


class TemplateSecurityError(TemplateError, SecurityError):
    """The template tried something the sandbox forbids."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers defines it (jinja's own tojson escapes HTML characters).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(content: Any) -> Any:
    """A list of OpenAI content parts becomes its text parts joined by
    newlines (what vLLM does for string templates); strings and None pass."""
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return content


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from e

    @classmethod
    def from_metadata(cls, meta: dict, override_path: str | Path | None = None) -> "ChatTemplate":
        if override_path is not None:
            source = Path(override_path).read_text(encoding="utf-8")
        else:
            source = meta.get("tokenizer.chat_template")
        tokens = meta.get("tokenizer.ggml.tokens") or []
        if not source:
            source = GEMMA if "<start_of_turn>" in tokens else CHATML

        def text(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

        return cls(source, text("bos_token_id"), text("eos_token_id"))

    # ------------------------------------------------------------------

    def _prepare(self, messages: list[dict]) -> list[dict]:
        msgs = [dict(m, content=_content_text(m.get("content"))) if "content" in m else dict(m) for m in messages]
        return fold_system(msgs) if self.source == GEMMA else msgs

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kw) -> str:
        return self._render(self._prepare(messages), add_generation_prompt, tools, kw)

    def _render(self, messages, add_generation_prompt, tools, kw) -> str:
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kw}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **variables
            )
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateSecurityError(f"chat template blocked by the sandbox: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def render_parts(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kw
    ) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, trusted) parts: trusted parts come
        from the template, untrusted ones are message contents."""
        msgs = self._prepare(messages)
        real = self._render(msgs, add_generation_prompt, tools, kw)

        # Sentinels: private-use characters and hex digits survive the usual
        # string filters (trim, upper, lower); the nonce keeps a user from
        # forging one.
        nonce = secrets.token_hex(4)
        sentinels: dict[str, str] = {}
        masked = []
        for i, m in enumerate(msgs):
            c = m.get("content")
            if isinstance(c, str) and c:
                s = f"\ue000{nonce}{i:x}\ue001"
                sentinels[s] = c
                m = dict(m, content=s)
            masked.append(m)
        if not sentinels:
            return [(real, True)]
        try:
            rendered = self._render(masked, add_generation_prompt, tools, kw)
        except TemplateError:
            rendered = None
        if rendered is not None:
            parts = _split_at(rendered, sentinels)
            # Valid only if putting the contents back gives the real render:
            # a template that transforms content (trim, slicing, testing it)
            # makes the sentinel render differ, and we fall back.
            if parts is not None and "".join(t for t, _ in parts) == real:
                return [p for p in parts if p[0]]
        return _locate(real, [m.get("content") for m in msgs])

    def render_and_encode(
        self, tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kw
    ) -> list[int]:
        parts = self.render_parts(messages, add_generation_prompt, tools, **kw)
        # add_special: BOS when the model wants one and the template did not
        # already write it (Gemma's does; a second BOS hurts the model).
        return tokenizer.encode_chat(parts, add_special=True)


def _split_at(rendered: str, sentinels: dict[str, str]) -> list[tuple[str, bool]] | None:
    parts: list[tuple[str, bool]] = []
    pos = 0
    while True:
        i = rendered.find("\ue000", pos)
        if i < 0:
            break
        j = rendered.find("\ue001", i)
        s = rendered[i : j + 1] if j >= 0 else None
        if s not in sentinels:
            return None  # a sentinel the template cut or changed
        parts.append((rendered[pos:i], True))
        parts.append((sentinels[s], False))
        pos = j + 1
    parts.append((rendered[pos:], True))
    if "\ue001" in "".join(t for t, trusted in parts if trusted):
        return None
    return parts


def _locate(real: str, contents: list[Any]) -> list[tuple[str, bool]]:
    """Fallback: find each content (or its stripped form) in order in the
    real render; the spans found are untrusted, the rest is template."""
    parts: list[tuple[str, bool]] = []
    pos = 0
    for c in contents:
        if not isinstance(c, str) or not c:
            continue
        for form in (c, c.strip()):
            i = real.find(form, pos) if form else -1
            if i >= 0:
                parts.append((real[pos:i], True))
                parts.append((form, False))
                pos = i + len(form)
                break
    parts.append((real[pos:], True))
    return [p for p in parts if p[0]]
