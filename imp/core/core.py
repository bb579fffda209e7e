"""The contract between a pure decision core and the actor shell around it.

A core is deterministic: its outputs are a function of its config and the
messages it has handled, in order. It reads no clock and no randomness; time
arrives in messages (Tick, StepResult.now_ns, Submit.arrival_ns). That is what
makes `python -m imp replay LOG` possible: feed a core the inputs recorded in
the log and compare what it emits with what was recorded.

The shell (imp.actors.base.CoreActor) owns the inbox and the event log; the
core owns its state and nothing else.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from imp.messages import Msg

Out = list[tuple[str, Msg]]  # (receiver, message), in emission order


class Core(Protocol):
    """What every decision core provides."""

    name: str  # actor name, e.g. "scheduler"
    config: msgspec.Struct  # frozen; recorded in the log header

    def handle(self, sender: str, msg: Msg) -> Out:
        """Apply one message; return the messages to send, in order."""
        ...


class CoreError(Exception):
    """A core received a message it cannot apply (a protocol bug)."""
