"""A GenerateRequest -> prompt token ids and SamplingParams: defaults and context, decided once.

`render` turns the request's prompt (chat messages through the template,
raw text, token ids, a FIM layout) into token ids; `sampling_params` fills
in the model's defaults and the context-derived limits. Ranges were checked
by the dialect that parsed the body; nothing here re-checks them.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import msgspec

from imp.engine.port import ModelCard
from imp.http.errors import bad
from imp.http.pipeline.reasoning import prompt_opens_think
from imp.http.pipeline.request import GenerateRequest, Message
from imp.constrain.errors import ConstraintError
from imp.http.pipeline.structured import COMPILE_TIMEOUT_S, compile_checked
from imp.messages import Constraint, Dry, SamplingParams
from imp.text import dry_breakers
from imp.text.chat_template import TemplateError
from imp.text.fim import build_infill
from imp.text.model import TextModel
from imp.tools.custom import block, tool_lark
from imp.tools.shortest import fewest_tokens, shortest_input


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # the prompt as text (echo; think-block detection)
    opens_think: bool  # the reply starts inside a think block


def _text_bytes(req: GenerateRequest) -> int:
    n = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in req.messages)
    for t in (req.prompt_text, *((req.infill.prefix, req.infill.suffix, req.infill.prompt) if req.infill else ())):
        n += len(t.encode("utf-8", "surrogatepass")) if t else 0
    return n


def check_size(req: GenerateRequest, tm: TextModel, card: ModelCard) -> None:
    """A prompt whose bytes cannot fit the context is refused before tokenizing: a text of N
    bytes is at least N / (the longest token's bytes) tokens, so no tokenizer pass is needed
    to know an 8 MB body does not fit an 8k window."""
    n = _text_bytes(req)
    least = n // tm.max_token_bytes
    if least >= card.context_length:
        raise bad(f"prompt is too long: {least} tokens > {card.context_length} maximum (the model's context; "
                  f"at least that many, counted from its {n} bytes)", req.prompt_param, "context_length_exceeded")


async def render_off_loop(req: GenerateRequest, tm: TextModel, card: ModelCard) -> Prompt:
    """`render` on a worker thread (after the size check), so templating and tokenizing a
    large prompt never stall the event loop: /health and running streams keep being served."""
    check_size(req, tm, card)
    return await asyncio.to_thread(render, req, tm)


def render(req: GenerateRequest, tm: TextModel) -> Prompt:
    if req.infill is not None:
        return _infill(req, tm)
    if req.prompt_ids is not None:
        bad_ids = [t for t in req.prompt_ids if not 0 <= t < tm.tokenizer.vocab_size]
        if bad_ids:
            raise bad(f"'{req.prompt_param}' token id {bad_ids[0]} is outside the vocabulary "
                      f"(0..{tm.tokenizer.vocab_size - 1})", req.prompt_param)
        ids = list(req.prompt_ids)
        return _nonempty(req, Prompt(ids, tm.tokenizer.decode(ids, skip_special=False), False))
    if req.prompt_text is not None:
        # the whole prompt is the caller's: control-token spellings count (llama.cpp, vLLM)
        ids = tm.tokenizer.encode(req.prompt_text, add_special=True, parse_special=True)
        return _nonempty(req, Prompt(ids, req.prompt_text, prompt_opens_think(req.prompt_text[-64:])))
    return _chat(req, tm)


def _nonempty(req: GenerateRequest, p: Prompt) -> Prompt:
    if not p.ids:
        raise bad(f"'{req.prompt_param}' is empty", req.prompt_param)
    return p


def _infill(req: GenerateRequest, tm: TextModel) -> Prompt:
    if tm.fim is None:
        raise bad("this model has no fill-in-the-middle tokens (no tokenizer.ggml.fim_pre/suf/mid_token_id, "
                  "no <fim_prefix>-style tokens)", "suffix" if req.endpoint == "completions" else None,
                  "fim_not_supported")
    f = req.infill
    ids = build_infill(tm.tokenizer, tm.fim, f.prefix, f.suffix, f.prompt,
                       [{"filename": n, "text": t} for n, t in f.extra], prompt_ids=list(f.prompt_ids)
                       if f.prompt_ids is not None else None)
    text = f.prefix + (f.prompt if f.prompt_ids is None else tm.tokenizer.decode(list(f.prompt_ids),
                                                                                 skip_special=False))
    return Prompt(ids, text, False)


def _chat(req: GenerateRequest, tm: TextModel) -> Prompt:
    """Render and tokenize the messages.

    continue_final_message (vLLM): the reply continues the last message, an
    assistant turn with text; the prompt is the render without a generation
    prompt, cut right after that text (the HF rule, trailing whitespace dropped).
    """
    messages = [m.template_dict() for m in req.messages]
    cont = req.continue_final_message
    try:
        parts = tm.template.render_parts(messages, add_generation_prompt=req.add_generation_prompt and not cont,
                                         tools=[dict(t) for t in req.tools] or None, **req.template_kwargs)
    except TemplateError as exc:
        raise bad(f"chat template error: {exc}", "messages", "template_error") from None
    if cont:
        final = messages[-1]["content"]
        k = max((i for i, (_, trusted) in enumerate(parts) if not trusted), default=-1)
        if k < 0 or parts[k][0].strip() != final.strip():
            raise bad("the chat template does not render the final message's text; cannot continue it",
                      "messages", "template_error")
        parts = parts[:k] + [(parts[k][0].rstrip(), False)]
    # add_special: BOS when the model wants one and the template did not write it
    ids = tm.tokenizer.encode_chat(parts, add_special=True)
    # A think block is open when the reply's own start opens one: the assistant
    # prefix being continued, or the template's text after the last message.
    k = max((i for i, (_, trusted) in enumerate(parts) if not trusted), default=-1)
    tail = parts[-1][0] if cont else "".join(t for t, _ in parts[k + 1:])
    return Prompt(ids, "".join(t for t, _ in parts), prompt_opens_think(tail))


def check_sampling_table(req: GenerateRequest, card: ModelCard) -> None:
    """The pairs the API reference refuses, and what this engine cannot do. Banned phrases rewind what the
    model wrote; a grammar's state, a forced tool call and mirostat's mu would each have to be rewound
    with it. The logit lens needs each layer's residual: the fused CPU forward and the GPU's keep it, the torch
    CPU forward (non-GGUF files) does not."""
    s = req.sampling
    if s.logit_lens and not card.logit_lens:
        raise bad(f"'logit_lens' is not available on this engine ({card.device}): its forward keeps no per-layer "
                  "residual (the CPU executor's fused GGUF forward and the GPU executor do)", "logit_lens",
                  "unsupported_parameter")
    if s.cfg_scale != 1.0:
        why = ("the conversation has no system message to leave out, and no 'cfg_negative_prompt' was given"
               if s.cfg_negative_prompt is None and not any(m.role in ("system", "developer") for m in req.messages)
               else "tools are not guided (a call's arguments would be pushed off their schema)" if req.tools
               or req.tool_plan is not None
               else "banned phrases rewind one sequence, not its shadow" if s.banned_strings or s.banned_regex
               else "each choice would need a shadow of its own; send n = 1" if req.n > 1 else "")
        if why:
            raise bad(f"'cfg_scale': {why}", "cfg_scale", "unsupported_combination")
    if not (s.banned_strings or s.banned_regex):
        return
    name = "banned_strings" if s.banned_strings else "banned_regex"
    c, field = req.effective_constraint
    if c is not None:
        raise bad(f"'{name}' cannot be combined with '{field}' (a constrained output is not rewound)", name,
                  "unsupported_combination")
    if s.mirostat:
        raise bad(f"'{name}' cannot be combined with 'mirostat' (its state is not rewound)", name,
                  "unsupported_combination")


def guidance_messages(req: GenerateRequest) -> GenerateRequest | None:
    """The shadow's conversation of a guided request (cfg_scale != 1): without its system messages, or with
    cfg_negative_prompt as the one system message; None when the request is not guided."""
    s = req.sampling
    if s.cfg_scale == 1.0:
        return None
    rest = tuple(m for m in req.messages if m.role not in ("system", "developer"))
    if s.cfg_negative_prompt is not None:
        rest = (Message(role="system", content=s.cfg_negative_prompt), *rest)
    return msgspec.structs.replace(req, messages=rest)


def check_context(req: GenerateRequest, prompt_len: int, card: ModelCard) -> int:
    """Room left for the reply; a prompt that fills the context is a 400."""
    remaining = card.context_length - prompt_len
    if remaining <= 0:
        # Anthropic's own wording: Claude Code parses "prompt is too long: N tokens > M maximum" to
        # tell the user the context is full (else a generic API error); OpenAI clients read the code
        raise bad(f"prompt is too long: {prompt_len} tokens > {card.context_length} maximum (the model's context)",
                  req.prompt_param, "context_length_exceeded")
    return remaining


def max_tokens(req: GenerateRequest, prompt_len: int, card: ModelCard, fixed_default: int | None,
               cap: int | None = None) -> int:
    """The reply's token budget: the request's, cut at the context end (llama.cpp and vLLM stop
    there rather than refuse: Claude Code asks for 32k-64k), else --max-tokens, else the rest
    of the context; never above --max-output-tokens (`cap`), which ends as a normal length stop."""
    remaining = check_context(req, prompt_len, card)
    if req.max_tokens is None:
        mt = min(fixed_default, remaining) if fixed_default else remaining
    else:
        mt = min(req.max_tokens, remaining)
    return min(mt, cap) if cap else mt


_BREAKERS: dict[tuple[int, tuple[str, ...]], tuple] = {}  # (tokenizer id, breakers) -> imp.sampling.dry table
_BREAKERS_MAX = 32


async def dry_params(req: GenerateRequest, prompt_ids, tm: TextModel) -> Dry | None:
    """The request's DRY settings (llama.cpp's defaults where it gave none), None when off. The breakers'
    table (a walk of the vocabulary) is kept per breaker set and made off the loop the first time."""
    s = req.sampling
    last_n = 64 if s.dry_penalty_last_n is None else s.dry_penalty_last_n
    if s.dry_multiplier == 0.0 or last_n == 0:
        return None
    strings = dry_breakers.DEFAULT_BREAKERS if s.dry_sequence_breakers is None else s.dry_sequence_breakers
    key = (id(tm.tokenizer), tuple(strings))
    table = _BREAKERS.get(key)
    if table is None:
        tok = tm.tokenizer
        pieces = tok.pieces() if hasattr(tok, "pieces") else [tok.piece_bytes(i) for i in range(tok.vocab_size)]
        table = await asyncio.to_thread(dry_breakers.breaker_table, pieces, strings,
                                        lambda b: tok.encode(b.decode("utf-8", "replace")))
        if len(_BREAKERS) >= _BREAKERS_MAX:
            _BREAKERS.pop(next(iter(_BREAKERS)))
        _BREAKERS[key] = table
    prefix = tuple(prompt_ids) if last_n < 0 else tuple(prompt_ids[max(0, len(prompt_ids) - last_n):])
    return Dry(multiplier=float(s.dry_multiplier), base=float(1.75 if s.dry_base is None else s.dry_base),
               allowed_length=2 if s.dry_allowed_length is None else int(s.dry_allowed_length), last_n=int(last_n),
               breakers=table, prefix=prefix)


def sampling_params(req: GenerateRequest, prompt_len: int, card: ModelCard, tm: TextModel,
                    fixed_max_tokens: int | None = None, cap: int | None = None, dry: Dry | None = None
                    ) -> SamplingParams:
    s, d = req.sampling, tm.defaults
    one_at_a_time = bool(s.banned_strings or s.banned_regex or s.logit_lens or s.cfg_scale != 1.0)  # .drafts
    top_k = d.top_k if s.top_k is None else s.top_k
    # top_k: 0 (or unset) is 50, as the reference says; negative or >= vocabulary is off
    top_k = 50 if top_k == 0 else (0 if top_k < 0 or top_k >= card.vocab_size else top_k)
    seed = secrets.randbits(63) if s.seed is None else s.seed & ((1 << 63) - 1)
    logprobs = req.top_logprobs if req.logprobs else -1
    # an echoed prompt's logprobs (completions' echo + logprobs) come from the same prompt scoring
    prompt_lp = max(req.top_logprobs, req.prompt_logprobs) if req.echo and req.logprobs else req.prompt_logprobs
    return SamplingParams(
        max_tokens=max_tokens(req, prompt_len, card, fixed_max_tokens, cap),
        temperature=float(d.temperature if s.temperature is None else s.temperature),
        top_p=float(d.top_p if s.top_p is None else s.top_p),
        top_k=int(top_k),
        min_p=float(d.min_p if s.min_p is None else s.min_p),
        typical_p=float(1.0 if s.typical_p is None else s.typical_p),
        repetition_penalty=float(d.repetition_penalty if s.repetition_penalty is None else s.repetition_penalty),
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        seed=int(seed),
        stop_token_ids=tm.eos_ids,
        ignore_eos=s.ignore_eos,
        logit_bias=s.logit_bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_lp,
        constraint=req.effective_constraint[0],
        # the request's word, else the server's (on only where the executor verifies drafts; not by default
        # beside banned phrases, whose rewinds cut the drafter's text)
        speculative=(card.speculative and not one_at_a_time) if s.speculative is None else s.speculative,
        mtp_k=s.mtp_k,
        dry=dry,
        mirostat=int(s.mirostat),
        mirostat_tau=float(5.0 if s.mirostat_tau is None else s.mirostat_tau),
        mirostat_eta=float(0.1 if s.mirostat_eta is None else s.mirostat_eta),
        banned_strings=s.banned_strings,
        banned_regex=s.banned_regex,
        logit_lens=int(s.logit_lens),
        cfg_scale=float(s.cfg_scale),
    )


def _shortest_call_tokens(tool, tokenizer) -> int | None:
    """The fewest tokens of the shortest call block the tool's grammar allows (None: no estimate:
    imp.tools.shortest reads plain Lark and regexes, not llguidance's extensions)."""
    text = shortest_input(tool_lark(tool))
    return None if text is None else fewest_tokens(tokenizer, block(tool.name, text))


async def compile_constraint(req: GenerateRequest, grammars) -> None:
    """Compile the request's grammar now (off the loop, under the deadline), so a schema or a
    tool set that cannot be enforced is a 400 before anything runs; the executor then finds it
    in the shared cache."""
    c, field = req.effective_constraint
    if c is None:
        return
    if grammars is None:
        raise bad(f"'{field}' needs the grammar engine, which this server runs without", field,
                  "constraints_unavailable")
    code = "tool_choice_unenforceable" if field == "tool_choice" else "invalid_constraint"
    customs = [t for t in req.tool_plan.tools if t.custom and t.grammar] if field == "tool_choice" else []
    for t in customs:  # each custom tool's own grammar first: a refusal names the tool
        try:
            await grammars.compile(Constraint("lark", tool_lark(t)), COMPILE_TIMEOUT_S)
        except ConstraintError as exc:
            raise bad(f"custom tool {t.name!r}: its {t.grammar[0]} grammar cannot be enforced: {exc.reason}",
                      "tools", "invalid_tool_grammar") from None
        if req.max_tokens is not None:
            need = await asyncio.to_thread(_shortest_call_tokens, t, grammars.tokenizer)
            if need is not None and need > req.max_tokens:
                raise bad(f"custom tool {t.name!r}: the shortest call its {t.grammar[0]} grammar allows takes {need} "
                          f"tokens, more than the {req.max_tokens} this request may generate; a call would be cut "
                          "before its input parses", "tools", "tool_call_exceeds_max_tokens")
    await compile_checked(grammars, c, field, code=code)
