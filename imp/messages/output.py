"""Rendering a request's output: ingress -> detok (how), detok -> ingress (the text)."""

from __future__ import annotations

from imp.messages.base import FinishReason, Msg
from imp.messages.step import PromptLogprob, SampledToken, TokenOut


class DeltaBatch(Msg):
    """detok -> ingress: the Deltas of one TokenBatch, in order."""

    deltas: tuple["Delta", ...]


class DetokOpen(Msg):
    """ingress -> detok: how to render a request's output."""

    req_id: str
    n: int = 1
    stop: tuple[str, ...] = ()
    skip_special: bool = True
    prompt_tail: tuple[int, ...] = ()  # last prompt tokens, for correct leading spaces


class DetokClose(Msg):
    """ingress -> detok: forget a request that never ran (rejected)."""

    req_id: str


class Delta(Msg):
    """detok -> ingress: one TokenOut rendered as text. `finish` is the TokenOut's, or
    STOP when a stop string ended the choice (`stop_str`, Anthropic's stop_sequence)."""

    out: TokenOut
    text: str
    finish: FinishReason = FinishReason.NONE
    stop_str: str = ""

    # the TokenOut's fields, read through (dialects read a Delta like the TokenOut it renders)
    @property
    def req_id(self) -> str:
        return self.out.req_id

    @property
    def index(self) -> int:
        return self.out.index

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.out.token_ids

    @property
    def prompt_tokens(self) -> int:
        return self.out.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.out.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.out.completion_tokens

    @property
    def logprobs(self) -> tuple[SampledToken, ...]:
        return self.out.logprobs

    @property
    def error(self) -> str:
        return self.out.error

    @property
    def prompt_logprobs(self) -> tuple[PromptLogprob, ...]:
        return self.out.prompt_logprobs
