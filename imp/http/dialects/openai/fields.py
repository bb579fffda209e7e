"""The OpenAI-family fields (chat, completions, llama.cpp's routes): names and ranges.

Ranges are the API reference's; anything outside is a 400 naming the field,
never a clamp that silently changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline.request import Sampling


def sampling(body: dict, vocab_size: int) -> Sampling:
    top_k = B.num(body, "top_k", -1, integer=True)
    seed = B.num(body, "seed", integer=True)
    return Sampling(
        temperature=B.num(body, "temperature", 0, 2),
        top_p=B.num(body, "top_p", 0, 1, lo_open=True),
        top_k=top_k,
        min_p=B.num(body, "min_p", 0, 1),
        typical_p=B.num(body, "typical_p", 0, 1, lo_open=True),
        repetition_penalty=B.num(body, "repetition_penalty", 0, lo_open=True),
        presence_penalty=float(B.num(body, "presence_penalty", -2, 2, default=0.0)),
        frequency_penalty=float(B.num(body, "frequency_penalty", -2, 2, default=0.0)),
        seed=seed,
        logit_bias=B.logit_bias(body, vocab_size),
        ignore_eos=B.boolean(body, "ignore_eos"),
    )


@dataclass(frozen=True)
class Common:
    """Fields every OpenAI-family generation route shares, parsed once."""

    n: int
    stream: bool
    include_usage: bool
    priority: int
    cache_prompt: bool
    session_id: str
    max_tokens: int | None
    stop: tuple[str, ...]
    lora: str = ""


def common(body: dict, *, max_tokens_name: str = "max_tokens") -> Common:
    n = B.num(body, "n", 1, 4, integer=True, default=1)
    best_of = B.num(body, "best_of", 1, integer=True)
    if best_of is not None and best_of > 1:
        raise bad("'best_of' > 1 is not supported: imp generates no candidate set to choose from", "best_of")
    stream = B.boolean(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if so is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    mt = B.num(body, "max_completion_tokens", 1, integer=True)
    if mt is None:
        mt = B.num(body, max_tokens_name, 1, integer=True)
    return Common(
        n=n,
        stream=stream,
        include_usage=bool(so and so.get("include_usage")),
        priority=B.num(body, "priority", -(2**31), 2**31 - 1, integer=True, default=0),
        cache_prompt=B.boolean(body, "cache_prompt"),
        session_id=B.session_id(body),
        max_tokens=mt,
        stop=B.stop_list(body),
        lora=B.lora_name(body),
    )


def prompt_logprobs(body: dict, *, allowed: bool, stream: bool) -> int:
    plp = B.num(body, "prompt_logprobs", 0, 20, integer=True)
    if plp is not None and not allowed:
        raise bad("'prompt_logprobs' is only supported on /v1/completions", "prompt_logprobs")
    if plp is not None and stream:
        raise bad("'prompt_logprobs' cannot be used with 'stream': true", "prompt_logprobs")
    return -1 if plp is None else plp
