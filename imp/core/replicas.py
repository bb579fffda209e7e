"""Data parallelism: one scheduler + KV allocator + executor per device.

With `--data-parallel N` the engine runs N replicas of the step loop, each
with its own model copy, KV pool and scheduler, named `scheduler.i`, `kv.i`,
`executor.i` (N = 1 keeps the plain names, so single-device logs are
unchanged). Admission picks the replica for each request (`pick`) and sends
its cancels and end_thinking to the same one; ingress, detok, metrics and
the clock are shared.

The scheduler and KV cores are written for the plain names; `Routed` wraps a
core so its messages for "kv" / "executor" / "scheduler" go to its own
replica's actors. It is pure like the core it wraps, so replay rebuilds it
from the name recorded in the log header (`imp.core.replay`).
"""

from __future__ import annotations

from imp.core.core import Out
from imp.messages import Msg

PEERS = ("scheduler", "kv", "executor")


def replica_name(base: str, index: int, replicas: int) -> str:
    return base if replicas <= 1 else f"{base}.{index}"


def split_name(name: str) -> tuple[str, int | None]:
    """'scheduler.1' -> ('scheduler', 1); 'scheduler' -> ('scheduler', None)."""
    base, _, idx = name.partition(".")
    return (base, int(idx)) if idx.isdigit() else (name, None)


class Routed:
    """A core whose messages to its peers go to the actors of replica `index`."""

    def __init__(self, core, index: int):
        self.core, self.index = core, index
        self.base = core.name
        self.name = f"{core.name}.{index}"
        self.config = core.config
        self.routes = {p: f"{p}.{index}" for p in PEERS if p != core.name}

    def handle(self, sender: str, msg: Msg) -> Out:
        return [(self.routes.get(r, r), m) for r, m in self.core.handle(sender, msg)]

    def __getattr__(self, attr):  # figures and state of the wrapped core (tests, /health)
        return getattr(self.core, attr)


def pick(loads: list[int], session_replica: int | None = None) -> int:
    """The replica for a new request: its session's, else the least reserved
    blocks (ties to the lowest index, so the choice is deterministic)."""
    if session_replica is not None:
        return session_replica
    return min(range(len(loads)), key=lambda i: (loads[i], i))
