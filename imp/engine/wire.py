"""What crosses between an API-server process and the engine process: typed frames.

The engine port (`imp.engine.port`) cut in two. Each frame is a tagged msgspec
Struct encoded with msgpack; a ZMQ message carries a batch of them (`Frames`),
one per event-loop turn and direction, so a step's tokens for a hundred streams
are one send. Token ids travel, never text per token: the engine's detok actor
runs raw and the API server renders (`imp.engine.render.RenderedStream`). Everything a
frame asks of the engine becomes messages on the engine's bus, so the engine
process's event log still holds every decision input.

    API server -> engine: Hello, Open, Close, StopChoice, Think, SessionEnd, Report, Call, StoreCall,
                          ControlReply
    engine -> API server: Welcome, Items, State, Answer, Control, Bye
"""

from __future__ import annotations

import os
from typing import Any, Union

import msgspec

from imp.engine.port import LoraInfo, ModelCard, Submission
from imp.messages import (Delta, Reject, RequestStats, StoreDelete, StoreGet, StoreGetChain, StoreListInputItems,
                          StorePut, TokenRows)


class Frame(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every frame; the tag is the class name."""


# ---------------------------------------------------------------- API server -> engine


class Hello(Frame):
    """An API server connected (or restarted: the engine cancels what its last life left)."""

    api: int
    pid: int


class Open(Frame):
    """Submit a request (port.submit). Stop strings stay with the API server. model: the fleet's model it
    names (models on demand; "" = the boot engine): the engine takes a lease on it, loading it if need be."""

    sub: Submission
    model: str = ""


class Close(Frame):
    """The API server is done with a request: cancelled if it still runs (client gone)."""

    req_id: str


class StopChoice(Frame):
    """A stop string ended one choice on the API side: free its KV now."""

    req_id: str
    index: int


class Think(Frame):
    req_id: str
    token_ids: tuple[int, ...]


class SessionEnd(Frame):
    session_id: str


class Report(Frame):
    stats: RequestStats


class Call(Frame):
    """An awaited port call: suspend, resume, drain, lora_load, lora_unload, snapshot,
    metrics_text. Answered by an `Answer` with the same call_id."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()
    model: str = ""  # the fleet model a per-model call (snapshot, warm, lora_*) is for; "" = the boot engine


StoreMsg = Union[StorePut, StoreGet, StoreGetChain, StoreDelete, StoreListInputItems]


class StoreCall(Frame):
    """A Responses store request; the engine forwards it to its store actor."""

    call_id: int
    msg: StoreMsg


# ---------------------------------------------------------------- engine -> API server


class Welcome(Frame):
    card: ModelCard
    engine_pid: int
    loras: tuple[LoraInfo, ...] = ()
    store: bool = False
    default_model: str = ""  # models on demand: the boot model's name in the fleet ("" = one model)


class Items(Frame):
    """Requests' output of one engine loop turn, in delivery order (token ids, no text)."""

    items: tuple[Union[Delta, Reject, TokenRows], ...]


class State(Frame):
    """Facts every API server answers synchronously from: sent on every change."""

    fault: str = ""
    loras: tuple[LoraInfo, ...] = ()
    # models on demand: each resident model's card and adapters (HTTP's LoRA names and admin read them)
    models: dict[str, ModelCard] = msgspec.field(default_factory=dict)
    model_loras: dict[str, tuple[LoraInfo, ...]] = msgspec.field(default_factory=dict)


class ModelUse(msgspec.Struct, frozen=True, array_like=True):
    """The answer to a "model_use" call: the fleet's model a name resolved to, resident now."""

    name: str
    path: str
    card: ModelCard


class Answer(Frame):
    """The reply to a Call or StoreCall: the value msgpack-encoded (the caller knows its
    type), or a refusal (status > 0) that the API server raises as the port would."""

    call_id: int
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # nil
    status: int = 0
    code: str = ""
    message: str = ""


class Control(Frame):
    """engine -> the other API servers: a control call for a request one of them runs
    (POST /v1/requests/{id}/end_thinking landed on a server that does not hold it)."""

    ask_id: int
    action: str
    some_id: str


class ControlReply(Frame):
    """API server -> engine: its answer to a Control (body None: not running here)."""

    ask_id: int
    status: int = 0
    body: dict | None = None


class Bye(Frame):
    """The engine has drained and stops: finish what is written, then exit."""


AnyFrame = Union[Hello, Open, Close, StopChoice, Think, SessionEnd, Report, Call, StoreCall, ControlReply,
                 Welcome, Items, State, Answer, Control, Bye]

def alive(pid: int) -> bool:
    """The process at the other end still runs (each side watches the other's pid: ZMQ
    itself never says a peer is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sent(fut) -> None:
    """A ZMQ asyncio send's future, not awaited (with no high-water mark it does not block):
    its exception, if any, is retrieved so that it is not reported as never retrieved."""
    if fut.done():
        fut.cancelled() or fut.exception()
    else:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[AnyFrame])


def encode(frames: list[Frame]) -> bytes:
    return _enc.encode(frames)


def decode(data: bytes) -> list[Frame]:
    return _dec.decode(data)


def raw(value) -> msgspec.Raw:
    return msgspec.Raw(_enc.encode(value))


def value(answer: Answer, typ):
    return msgspec.msgpack.decode(answer.value, type=typ)
