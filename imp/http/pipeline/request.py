"""The one typed request every generation dialect maps its wire body into.

A dialect parses its own body once — its own field names, its own ranges,
its own error messages — into a `GenerateRequest`; from there every dialect
shares one path: `imp.http.resolve` renders and tokenizes the prompt and
resolves the sampling defaults (in that one place), `imp.http.driver` runs
it. No dialect builds another dialect's body.

`None` in a sampling field means "the model's default"; the resolver fills
it in. Everything else is already validated when the struct exists.
"""

from __future__ import annotations

from typing import Any

import msgspec

from imp.messages import Constraint


class _Value(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class Message(_Value):
    """One template-ready chat message (content already flattened to text)."""

    role: str  # system | user | assistant | tool
    content: str = ""
    name: str | None = None
    tool_calls: tuple[dict, ...] | None = None  # OpenAI shape, as the chat template reads them
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class Infill(_Value):
    """llama.cpp's fill-in-the-middle fields (also /v1/completions' prompt + suffix)."""

    prefix: str = ""
    suffix: str = ""
    prompt: str = ""
    prompt_ids: tuple[int, ...] | None = None  # a token-id prompt between prefix and suffix
    extra: tuple[tuple[str, str], ...] = ()  # (filename, text) chunks of repository context


class Sampling(_Value):
    """Sampling fields as the client sent them; None = the model's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: one is drawn, so a request is reproducible from its log
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None  # None: the server's --speculative
    mtp_k: int = -1  # {"speculative": {"mtp_k": N}}; -1 = not asked
    # DRY (llama.cpp's fields): multiplier 0 = off; None = llama.cpp's default
    dry_multiplier: float = 0.0
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    mirostat: int = 0  # 1 or 2 (llama.cpp's); 0 = off
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    banned_strings: tuple[str, ...] = ()  # phrases that rewind (imp.core.banned)
    banned_regex: tuple[str, ...] = ()
    logit_lens: int = 0  # top N per layer (chat)
    cfg_scale: float = 1.0  # classifier-free guidance (chat); 1 = off
    cfg_negative_prompt: str | None = None  # the shadow's system message (None: the conversation without one)


class GenerateRequest(_Value):
    endpoint: str  # chat_completions | completions | messages | infill | responses (metrics label)
    model: str | None = None
    # the prompt: chat messages, or raw text / token ids, or a fill-in-the-middle layout
    messages: tuple[Message, ...] = ()
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    infill: Infill | None = None
    prompt_param: str = "messages"  # the field a prompt-length error names
    # chat template
    tools: tuple[dict, ...] = ()  # OpenAI-shaped function tools, shown to the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    template_kwargs: dict[str, Any] = {}
    # sampling and limits
    sampling: Sampling = Sampling()
    max_tokens: int | None = None  # None: the rest of the context (or --max-tokens)
    n: int = 1
    stop: tuple[str, ...] = ()
    # what to return
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int = -1  # -1 = not asked; else the top N per prompt token
    echo: bool = False
    # scheduling
    priority: int = 0
    cache_prompt: bool = False
    session_id: str = ""
    lora: str = ""  # a loaded LoRA adapter's name ("" = the base model, unless `model` names one)
    # what the output must match: a structured-output constraint (and the field that set it),
    # and the request's tools (an imp.http.tool_use.ToolPlan: shape, forced grammar, parser)
    constraint: Constraint | None = None
    constraint_field: str | None = None
    tool_plan: Any = None
    # Anthropic cache_control: the last marked block (imp.http.dialects.anthropic.parse.cache_breakpoint): its
    # message index, -1 the tools / system prompt, -2 none; pin_tokens: the prompt tokens that bounds, found
    # once the prompt is rendered (the pipeline), kept warm after the request (0: none)
    cache_breakpoint: int = -2
    pin_tokens: int = 0

    @property
    def effective_constraint(self) -> tuple[Constraint | None, str | None]:
        """The grammar the output runs under, and the field a refusal names."""
        if self.constraint is not None:
            return self.constraint, self.constraint_field
        if self.tool_plan is not None and self.tool_plan.constraint is not None:
            return self.tool_plan.constraint, "tool_choice"
        return None, None
