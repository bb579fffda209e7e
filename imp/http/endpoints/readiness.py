"""What a load balancer is told, decided in one place from one Snapshot.

Three answers, three audiences:

- `not_ready(snap)`: /ready's code. A *state* (faulted, suspended, draining), never load:
  an orchestrator's readiness probe or HAProxy's `check` takes the backend out on it, and
  load must not do that (under 8 streams `/health?ready=1` as the check took both backends
  out at once: 49 of 64 requests failed).
- `busy(snap, card)`: `/health?ready=1`'s one-word reason: "would a request start *now*".
  It answers 503 under ordinary load by design: a client that fans out reads it, a balancer's
  check must not.
- `agent_line(snap, card)`: HAProxy's agent-check answer (`--agent-port`): the state as
  `down` / `drain`, else `up ready N%` with a weight that falls smoothly with queue and KV
  pressure and never reaches 0. Load moves traffic (leastconn divides connections by the
  weight) but never takes a backend out, so it cannot flap. The weight moves in steps of 10
  so a busy server does not rewrite HAProxy's weights every check for a one-block change.
"""

from __future__ import annotations

from imp.engine.port import ModelCard, Snapshot
from imp.http.endpoints.capacity import band_of, kv_pressure  # the memory band: decided there

MIN_WEIGHT = 10  # percent: a loaded backend still takes its share when every backend is loaded


def not_ready(snap: Snapshot) -> str | None:
    """/ready's 503 code, or None (ready). An idle suspend stays ready: the next request reloads."""
    if snap.fault:
        return "engine_faulted"
    if snap.suspended:
        return "suspended"
    if snap.draining:
        return "draining"
    return None


def busy(snap: Snapshot, card: ModelCard) -> str | None:
    """/health?ready=1's reason a new request would not start at once, or None."""
    state = not_ready(snap)
    if state in ("suspended", "draining"):
        return state
    if band_of(snap.kv) in ("orange", "red"):
        return "pressure"
    if snap.queue.waiting > 0:
        return "queue"
    if snap.queue.running >= card.max_batch_size * card.replicas:
        return "busy"
    return None


def weight(snap: Snapshot, card: ModelCard) -> int:
    """Percent of the configured weight: 100 idle, down to MIN_WEIGHT as the slots fill, the
    queue grows or the KV pool fills (whichever is worst), in steps of 10."""
    slots = max(1, card.max_batch_size * card.replicas)
    load = max(snap.queue.running / slots, kv_pressure(snap.kv)) + snap.queue.waiting / slots
    pct = 10 * round(10 * (1.0 - min(1.0, load)))
    return max(MIN_WEIGHT, min(100, pct))


def agent_line(snap: Snapshot, card: ModelCard, others: tuple = ()) -> str:
    """One HAProxy agent-check reply line. `down` for a fault (restart it), `drain` while suspended
    or draining (no new connections; those running finish), else `up ready N%`: `ready` lifts a
    drain this server asked for earlier (HAProxy keeps an agent's drain until told otherwise).
    others: (Snapshot, ModelCard) of the other resident models (--models-dir): they share this
    server's compute, so a fault in any is `down` and the busiest one sets the weight."""
    state = not_ready(snap)
    if state != "engine_faulted" and any(o.fault for o, _ in others):
        state = "engine_faulted"
    if state == "engine_faulted":
        return "down #engine_faulted\n"
    if state:
        return f"drain #{state}\n"
    return f"up ready {min(weight(s, c) for s, c in ((snap, card), *others))}%\n"
