"""The OpenAI-family fields (chat, completions, llama.cpp's routes): names and ranges.

Ranges are the API reference's; anything outside is a 400 naming the field,
never a clamp that silently changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline.request import Sampling


# the OpenAI family's sampling fields and their ranges (the API reference's)
SAMPLING = {
    "temperature": B.Num(0, 2),
    "top_p": B.Num(0, 1, lo_open=True),
    "top_k": B.Num(-1, integer=True),
    "min_p": B.Num(0, 1),
    "typical_p": B.Num(0, 1, lo_open=True),
    "repetition_penalty": B.Num(0, lo_open=True),
    "presence_penalty": B.Num(-2, 2, default=0.0),
    "frequency_penalty": B.Num(-2, 2, default=0.0),
    "seed": B.Num(integer=True),
    "ignore_eos": B.Bool(),
    "speculative": B.Read(B.speculative),
    # DRY, llama.cpp's names and meanings (imp.sampling.dry); base below 1 would make it reward repeats
    "dry_multiplier": B.Num(0, default=0.0),
    "dry_base": B.Num(1),
    "dry_allowed_length": B.Num(0, integer=True),
    "dry_penalty_last_n": B.Num(-1, integer=True),
    "dry_sequence_breakers": B.Read(B.dry_breakers),
    # mirostat v1 / v2, llama.cpp's names and defaults (imp.sampling.mirostat)
    "mirostat": B.Num(0, 2, integer=True, default=0),
    "mirostat_tau": B.Num(0),
    "mirostat_eta": B.Num(0),
    # banned phrases with rewind (imp.core.banned): TabbyAPI's strings, and regexes
    "banned_strings": B.Read(B.banned_strings),
    "banned_regex": B.Read(B.banned_regex),
}
# what every OpenAI-family generation route takes besides its prompt and sampling
COMMON = {
    "n": B.Num(1, 4, integer=True, default=1),
    "best_of": B.Num(1, integer=True),
    "stream": B.Bool(),
    "stream_options": B.Obj(),
    "max_completion_tokens": B.Num(1, integer=True),
    "max_tokens": B.Num(1, integer=True),
    "stop": B.Read(B.stop_list),
    **B.SCHEDULING,
}


def sampling_of(f: dict, logit_bias: tuple) -> Sampling:
    """The sampling fields of a read table -> Sampling (None = the model's default)."""
    return Sampling(
        temperature=f["temperature"], top_p=f["top_p"], top_k=f["top_k"], min_p=f["min_p"], typical_p=f["typical_p"],
        repetition_penalty=f["repetition_penalty"], presence_penalty=float(f["presence_penalty"]),
        frequency_penalty=float(f["frequency_penalty"]), seed=f["seed"], logit_bias=logit_bias,
        ignore_eos=f["ignore_eos"], speculative=f["speculative"][0], mtp_k=f["speculative"][1],
        dry_multiplier=float(f["dry_multiplier"]), dry_base=f["dry_base"], dry_allowed_length=f["dry_allowed_length"],
        dry_penalty_last_n=f["dry_penalty_last_n"], dry_sequence_breakers=f["dry_sequence_breakers"],
        mirostat=f["mirostat"], mirostat_tau=f["mirostat_tau"], mirostat_eta=f["mirostat_eta"],
        banned_strings=f["banned_strings"], banned_regex=f["banned_regex"])


def sampling(body: dict, vocab_size: int) -> Sampling:
    return sampling_of(B.read(body, SAMPLING), B.logit_bias(body, vocab_size))


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


def common_of(f: dict) -> Common:
    """The COMMON fields of a read table -> Common, with the checks that join two fields."""
    if f["best_of"] is not None and f["best_of"] > 1:
        raise bad("'best_of' > 1 is not supported: imp generates no candidate set to choose from", "best_of")
    so = f["stream_options"]
    if so is not None and not f["stream"]:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    mt = f["max_completion_tokens"] if f["max_completion_tokens"] is not None else f["max_tokens"]
    return Common(n=f["n"], stream=f["stream"], include_usage=bool(so and so.get("include_usage")),
                  priority=f["priority"], cache_prompt=f["cache_prompt"], session_id=f["session_id"],
                  max_tokens=mt, stop=f["stop"], lora=f["lora"])


def common(body: dict) -> Common:
    return common_of(B.read(body, COMMON))


LOGPROBS = {"logprobs": B.Bool(), "top_logprobs": B.Num(0, 20, integer=True),
            "prompt_logprobs": B.Num(0, 20, integer=True)}


def prompt_logprobs(plp: int | None, *, allowed: bool, stream: bool) -> int:
    """prompt_logprobs as read -> the top N per prompt token, -1 = not asked."""
    if plp is not None and not allowed:
        raise bad("'prompt_logprobs' is only supported on /v1/completions", "prompt_logprobs")
    if plp is not None and stream:
        raise bad("'prompt_logprobs' cannot be used with 'stream': true", "prompt_logprobs")
    return -1 if plp is None else plp
