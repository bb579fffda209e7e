"""A synchronous in-process router for decision cores (tests and replay).

Messages travel FIFO, exactly as the actor bus delivers them: a core's
outputs queue behind whatever was already sent. Every message gets a
sequence number when it is sent and is recorded; those addressed to a name
with no core ("executor", "detok", "metrics", "ingress", ...) are recorded
and left for the caller.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import NamedTuple

from imp.core.core import Core
from imp.messages import Msg


class Delivery(NamedTuple):
    seq: int
    sender: str
    receiver: str
    msg: Msg


def check_frozen(msg, where: str = "") -> None:
    """Raise if a message holds a list anywhere: messages are deep-frozen (tuples), so the
    log records exactly what the receiver saw. The router checks every delivery, which is
    how the state machines and replay hold every core to it."""
    if isinstance(msg, list):
        raise TypeError(f"{where or type(msg).__name__}: a list inside a message (use a tuple)")
    if isinstance(msg, tuple):
        for i, x in enumerate(msg):
            check_frozen(x, f"{where}[{i}]")
    elif hasattr(msg, "__struct_fields__"):
        for f in msg.__struct_fields__:
            check_frozen(getattr(msg, f), f"{where or type(msg).__name__}.{f}")


class Router:
    def __init__(self, cores: dict[str, Core]):
        self.cores = cores
        self.log: list[Delivery] = []

    def send(self, inputs: Iterable[tuple[str, str, Msg]]) -> list[Delivery]:
        """Send (sender, receiver, msg) inputs; run until quiet. Returns the
        records of this call addressed outside the cores, in order."""
        start = len(self.log)
        queue: collections.deque[Delivery] = collections.deque()
        for sender, receiver, msg in inputs:
            queue.append(self._record(sender, receiver, msg))
        while queue:
            d = queue.popleft()
            core = self.cores.get(d.receiver)
            if core is not None:
                for receiver, msg in core.handle(d.sender, d.msg):
                    queue.append(self._record(d.receiver, receiver, msg))
        return [d for d in self.log[start:] if d.receiver not in self.cores]

    def _record(self, sender: str, receiver: str, msg: Msg) -> Delivery:
        check_frozen(msg)
        d = Delivery(len(self.log) + 1, sender, receiver, msg)
        self.log.append(d)
        return d


def route(cores: dict[str, Core], inputs: Iterable[tuple[str, str, Msg]]) -> list[Delivery]:
    """Deliver inputs among cores until quiet; the full log, in send order."""
    router = Router(cores)
    router.send(inputs)
    return router.log


def dump(router: Router, path, note: str = "") -> None:
    """Write a router's deliveries as an event log that `python -m imp replay` reads.

    A failing hypothesis case calls this, so its exact interleaving can be
    saved under replay/ and stepped through (`python -m imp replay LOG --step`).
    """
    import msgspec

    from imp.log.eventlog import Envelope, EventLog, LogHeader
    from imp.messages import SCHEMA_VERSION

    kv = router.cores.get("kv")
    log = EventLog(path)
    log.open(LogHeader(
        SCHEMA_VERSION,
        getattr(getattr(kv, "config", None), "fingerprint", ""),
        {name: msgspec.to_builtins(c.config) for name, c in router.cores.items()},
        note=note,
    ))
    step = 0
    for d in router.log:
        step = getattr(d.msg, "step", step) if d.sender.startswith("scheduler") else step
        log.append(Envelope(d.seq, d.sender, d.receiver, step, 0, d.msg))
    log.close()
