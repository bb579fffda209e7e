"""Rendering a request's output: ingress -> detok (how), detok -> ingress (the text)."""

from __future__ import annotations

from operator import attrgetter

from imp.messages.base import FinishReason, Msg
from imp.messages.step import TokenOut, TokenRows


class DeltaBatch(Msg):
    """detok -> ingress: the Deltas of one TokenBatch, in order; its rows as they came (`TokenBatch.rows`,
    delivered as if they stood at `deltas[rows_at]`)."""

    deltas: tuple["Delta", ...]
    rows: TokenRows | None = None
    rows_at: int = 0


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
    req_id = property(attrgetter("out.req_id"))
    index = property(attrgetter("out.index"))
    token_ids = property(attrgetter("out.token_ids"))
    prompt_tokens = property(attrgetter("out.prompt_tokens"))
    cached_tokens = property(attrgetter("out.cached_tokens"))
    completion_tokens = property(attrgetter("out.completion_tokens"))
    logprobs = property(attrgetter("out.logprobs"))
    error = property(attrgetter("out.error"))
    prompt_logprobs = property(attrgetter("out.prompt_logprobs"))
