"""Old event-log schema versions, read and upcast to the current catalogue.

A log keeps the schema it was written with (its header says which). Reading
an old one decodes each frame with that version's message shapes and maps
the messages whose shape changed to today's, so replay compares like with
like. Only what changed is redefined here; everything else decodes with the
current classes (a new trailing field with a default reads old records as is,
and msgpack arrays decode into the tuples the catalogue now uses).

v2 -> v3: `Enqueue` wraps its `Submit` instead of restating its fields;
`Delta` wraps its `TokenOut` (and `DeltaBatch` carries v3 Deltas).
"""

from __future__ import annotations

import typing
from typing import Callable, Union

import msgspec

from imp import messages as m


class _V2(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class EnqueueV2(_V2, tag="Enqueue"):
    req_id: str
    prompt: tuple[int, ...]
    params: m.SamplingParams
    arrival_ns: int
    n: int = 1
    priority: int = 0
    salt: str = ""
    reserved_blocks: int = 0
    cache_prompt: bool = False
    session_id: str = ""


class DeltaV2(_V2, tag="Delta"):
    req_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish: m.FinishReason = m.FinishReason.NONE
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[m.SampledToken, ...] = ()
    error: str = ""
    prompt_logprobs: tuple[m.PromptLogprob, ...] = ()
    stop_str: str = ""


class DeltaBatchV2(_V2, tag="DeltaBatch"):
    deltas: tuple[DeltaV2, ...]


def _enqueue(e: EnqueueV2) -> m.Enqueue:
    sub = m.Submit(e.req_id, e.prompt, e.params, e.arrival_ns, e.n, e.priority, e.salt, e.cache_prompt,
                   e.session_id)
    return m.Enqueue(sub, e.reserved_blocks)


def _delta(d: DeltaV2) -> m.Delta:
    out = m.TokenOut(d.req_id, d.index, d.token_ids, d.finish, d.prompt_tokens, d.cached_tokens,
                     d.completion_tokens, d.logprobs, d.error, d.prompt_logprobs)
    return m.Delta(out, d.text, d.finish, d.stop_str)


_CHANGED_V2: dict[type, Callable] = {
    EnqueueV2: _enqueue,
    DeltaV2: _delta,
    DeltaBatchV2: lambda b: m.DeltaBatch(tuple(_delta(d) for d in b.deltas)),
}
_REPLACED_V2 = {"Enqueue", "Delta", "DeltaBatch"}


def _union_v2():
    current = [t for t in typing.get_args(m.Message) if t.__name__ not in _REPLACED_V2]
    return Union[tuple(current + list(_CHANGED_V2))]  # noqa: UP007 - a runtime union of classes


class Version(typing.NamedTuple):
    payload_type: object  # the msgspec type a frame's payload decodes as
    upcast: Callable[[msgspec.Struct], msgspec.Struct]  # that payload -> today's message


def _upcaster(changed: dict[type, Callable]) -> Callable:
    def up(msg):
        f = changed.get(type(msg))
        return f(msg) if f is not None else msg

    return up


# schema version -> how to read it (the current version reads as is)
READERS: dict[int, Version] = {
    2: Version(_union_v2(), _upcaster(_CHANGED_V2)),
    m.SCHEMA_VERSION: Version(m.Message, lambda msg: msg),
}
