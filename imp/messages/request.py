"""A request's admission and control: ingress -> admission -> scheduler, and back.

    ingress -Submit-> admission -Enqueue-> scheduler         (or admission -Reject-> ingress)
    ingress -Cancel / EndThinking / SessionClose-> admission -> scheduler
    ingress -Suspend / Resume-> admission
    scheduler -Finished-> admission                          (releases the queued-token accounting)
    clock -Tick-> scheduler                                  (time enters the cores only here)
"""

from __future__ import annotations

from imp.messages.base import FinishReason, Msg
from imp.messages.params import SamplingParams


class Submit(Msg):
    """ingress -> admission: a new request, already tokenized."""

    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival_ns: int
    n: int = 1
    priority: int = 0
    salt: str = ""
    cache_prompt: bool = False  # pin the prompt's full KV blocks against eviction
    session_id: str = ""  # pin the prompt for the session's next turn (until closed/expired)
    # classifier-free guidance (params.cfg_scale > 1): the shadow sequence's prompt (the conversation without
    # its system message, or with the negative prompt as one); it decodes the choice's tokens beside it
    cfg_prompt: tuple[int, ...] = ()
    # Anthropic cache_control: pin the first pin_tokens prompt tokens' full blocks when it ends, as cache_prompt
    # pins the whole prompt (0: none)
    pin_tokens: int = 0


class Reject(Msg):
    """admission/scheduler -> ingress: the request will not run."""

    req_id: str
    status: int
    code: str
    message: str
    retry_after_s: float = 0.0


class Enqueue(Msg):
    """admission -> scheduler: an admitted request: its Submit, and the blocks reserved for it."""

    submit: Submit
    reserved_blocks: int = 0


class Cancel(Msg):
    """ingress -> admission -> scheduler: end a request early."""

    req_id: str
    reason: FinishReason = FinishReason.CANCELLED
    index: int = -1  # the choice to end (a stop string in one of n); -1 = all


class SessionClose(Msg):
    """ingress -> admission -> scheduler: unpin a session's prompt now."""

    session_id: str


class EndThinking(Msg):
    """ingress -> admission -> scheduler: append `token_ids` (the model's
    `</think>` spelling) to every running choice of the request as forced
    output tokens, so the model continues with the answer on the same KV."""

    req_id: str
    token_ids: tuple[int, ...]


class Suspend(Msg):
    """ingress -> admission: stop admitting (POST /admin/suspend). New requests
    are refused with 503 `suspended`; admitted ones run to their end."""

    reason: str = "operator"


class Resume(Msg):
    """ingress -> admission: admit again (POST /admin/resume)."""


class Finished(Msg):
    """scheduler -> admission: a request left the scheduler (any reason)."""

    req_id: str
    reason: FinishReason


class Tick(Msg):
    """clock -> scheduler: the time, for timeouts and aging."""

    now_ns: int


class TokenTexts(Msg):
    """engine -> scheduler, before the first request with banned strings or regexes: every token's
    text (special tokens empty), so the scheduler's rewind decisions (imp.core.banned) need no
    tokenizer and a replay no model. offsets: n + 1 little-endian int64, item i is
    blob[offsets[i]:offsets[i + 1]]."""

    blob: bytes
    offsets: bytes
