"""The bases of the catalogue: `Msg` (a message: tagged by its class name), `Struct` (a value
carried inside messages), and `FinishReason`, which several conversations carry."""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.IntEnum):
    """Why a sequence ended. NONE while it runs."""

    NONE = 0
    STOP = 1  # EOS / stop token / stop string
    LENGTH = 2  # max_tokens or context end
    CANCELLED = 3  # client went away
    TIMEOUT = 4  # --request-timeout; reported to the client as "length"
    ERROR = 5  # executor fault
    REJECTED = 6  # refused after enqueue (cannot ever fit)


class Struct(
    msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False
):
    """Plain value carried inside messages (not itself a message)."""


class Msg(
    msgspec.Struct,
    frozen=True,
    array_like=True,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base of every message; the tag is the class name."""
