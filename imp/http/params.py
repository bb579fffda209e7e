"""Request fields -> SamplingParams, with imp's defaults and the reference's ranges.

Every check names the offending field (`param`) so a client can fix it. The
ranges are the API reference's; anything outside is a 400, never a clamp
that silently changes the output.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from imp.http.errors import bad
from imp.messages import SamplingParams

_MISSING = object()


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def num(body: dict, name: str, lo=None, hi=None, *, integer=False, default=None,
        lo_open=False, hi_open=False):
    """A numeric field: None/absent -> default; wrong type or range -> 400."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if integer:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    elif not _is_num(v):
        raise bad(f"'{name}' must be a number, got {type(v).__name__}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be finite", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise bad(f"'{name}' must be {'<' if hi_open else '<='} {hi}, got {v}", name)
    return v


def boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return v


def string(body: dict, name: str, default: str | None = None, *, required=False) -> str | None:
    v = body.get(name)
    if v is None:
        if required:
            raise bad(f"'{name}' is required", name)
        return default
    if not isinstance(v, str):
        raise bad(f"'{name}' must be a string", name)
    return v


def stop_list(body: dict, name: str = "stop") -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'{name}' must be a string or a list of strings", name)
    if len(v) > 16:
        raise bad(f"'{name}' takes at most 16 strings", name)
    return [s for s in v if s]


@dataclass(frozen=True)
class ModelDefaults:
    """Sampling defaults of the loaded model (GGUF general.sampling.*, else arch preset)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0  # 0 = 50 (the reference's rule)
    min_p: float = 0.0
    repetition_penalty: float = 1.05

    @classmethod
    def from_metadata(cls, meta: dict) -> "ModelDefaults":
        d = cls()
        kw = {}
        for key, field in (("general.sampling.temp", "temperature"), ("general.sampling.top_p", "top_p"),
                           ("general.sampling.top_k", "top_k"), ("general.sampling.min_p", "min_p")):
            if isinstance(meta.get(key), (int, float)):
                kw[field] = type(getattr(d, field))(meta[key])
        return cls(**kw) if kw else d


@dataclass(frozen=True)
class GenRequest:
    params: SamplingParams
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    priority: int
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int = -1  # -1 = not asked; else top N per prompt token (completions)
    cache_prompt: bool = False
    session_id: str = ""


def sampling(body: dict, *, defaults: ModelDefaults, vocab_size: int, prompt_len: int,
             max_context: int, fixed_max_tokens: int | None, eos_ids: tuple[int, ...],
             chat: bool = True) -> GenRequest:
    temperature = num(body, "temperature", 0, 2, default=defaults.temperature)
    top_p = num(body, "top_p", 0, 1, lo_open=True, default=defaults.top_p)
    top_k = num(body, "top_k", -1, integer=True, default=defaults.top_k)
    top_k = 50 if top_k in (0, None) else (0 if top_k < 0 or top_k >= vocab_size else top_k)
    min_p = num(body, "min_p", 0, 1, default=defaults.min_p)
    typical_p = num(body, "typical_p", 0, 1, lo_open=True, default=1.0)
    rep = num(body, "repetition_penalty", 0, lo_open=True, default=defaults.repetition_penalty)
    presence = num(body, "presence_penalty", -2, 2, default=0.0)
    frequency = num(body, "frequency_penalty", -2, 2, default=0.0)
    seed = num(body, "seed", integer=True, default=None)
    seed = secrets.randbits(63) if seed is None else seed & ((1 << 63) - 1)
    n = num(body, "n", 1, 4, integer=True, default=1)
    best_of = num(body, "best_of", 1, integer=True, default=None)
    if best_of is not None and best_of > 1:
        raise bad("'best_of' > 1 is not supported: imp generates no candidate set to choose from", "best_of")
    priority = num(body, "priority", -(2**31), 2**31 - 1, integer=True, default=0)
    ignore_eos = boolean(body, "ignore_eos")
    stream = boolean(body, "stream")
    cache_prompt = boolean(body, "cache_prompt")
    session_id = string(body, "session_id", "")
    if len(session_id) > 256 or any(not c.isprintable() for c in session_id):
        raise bad("'session_id' must be at most 256 printable characters", "session_id")
    plp = num(body, "prompt_logprobs", 0, 20, integer=True, default=None)
    if plp is not None and chat:
        raise bad("'prompt_logprobs' is only supported on /v1/completions", "prompt_logprobs")
    if plp is not None and stream:
        raise bad("'prompt_logprobs' cannot be used with 'stream': true", "prompt_logprobs")

    remaining = max_context - prompt_len
    if remaining <= 0:
        raise bad(f"the prompt has {prompt_len} tokens, the model's context is {max_context} tokens",
                  "messages" if chat else "prompt", "context_length_exceeded")
    mt = num(body, "max_completion_tokens", 1, integer=True, default=None)
    if mt is None:
        mt = num(body, "max_tokens", 1, integer=True, default=None)
    if mt is None:
        mt = min(fixed_max_tokens, remaining) if fixed_max_tokens else remaining
    elif prompt_len + mt > max_context:
        mt = remaining  # llama.cpp/vLLM behaviour: generation stops at the context end

    logit_bias = body.get("logit_bias")
    bias: list[tuple[int, float]] = []
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise bad("'logit_bias' must be an object of token id -> bias", "logit_bias")
        for k, v in logit_bias.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise bad(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
            if not 0 <= tid < vocab_size:
                raise bad(f"'logit_bias' token id {tid} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias")
            if not _is_num(v) or not math.isfinite(v) or not -100 <= v <= 100:
                raise bad(f"'logit_bias' value for {k} must be a number in [-100, 100]", "logit_bias")
            bias.append((tid, float(v)))

    if chat:
        logprobs = boolean(body, "logprobs")
        top = num(body, "top_logprobs", 0, 20, integer=True, default=None)
        if top is not None and not logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        top = top or 0
    else:
        lp = num(body, "logprobs", 0, 20, integer=True, default=None)
        logprobs, top = lp is not None, lp or 0

    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(so and so.get("include_usage"))
    if so is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")

    params = SamplingParams(
        max_tokens=int(mt),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        typical_p=float(typical_p),
        repetition_penalty=float(rep),
        presence_penalty=float(presence),
        frequency_penalty=float(frequency),
        seed=int(seed),
        stop_token_ids=tuple(eos_ids),
        ignore_eos=ignore_eos,
        logit_bias=tuple(bias),
        logprobs=top if logprobs else -1,
        prompt_logprobs=-1 if plp is None else plp,
    )
    return GenRequest(params, n, stop_list(body), stream, include_usage, priority, logprobs, top,
                      -1 if plp is None else plp, cache_prompt, session_id)
