"""PENDING_TOKEN: the one place a pipelined share's unknown token is resolved.

With a depth-2 scheduler a share may feed PENDING_TOKEN: the token the step
still in flight samples for its sequence (`SeqWork.pending == 1`; its
`history` lacks that token). Whoever runs the share fills it in from the
previous step's samples: the CPU executor on the host (`resolve_pending`),
the GPU runner on the device (`pending_rows` says which rows read which
sampled slot; `fill` completes the host copy's history for penalties).
"""

from __future__ import annotations

from collections.abc import Container, Mapping

import msgspec

from imp.messages import PENDING_TOKEN, SeqWork


def check(w: SeqWork) -> None:
    """A pending share is one PENDING_TOKEN that samples: anything else is a scheduler bug."""
    if w.pending != 1 or tuple(w.token_ids) != (PENDING_TOKEN,) or not w.sample:
        raise ValueError(f"{w.seq_id}: pending {w.pending} with tokens {list(w.token_ids)[:4]}")


def fill(w: SeqWork, token: int) -> SeqWork:
    """The share with its pending token known: fed, and in the history when the sampler reads it
    (a penalty counts it, a grammar's state follows it)."""
    check(w)
    history = (*w.history, token) if w.params is not None and w.params.needs_history else w.history
    return msgspec.structs.replace(w, token_ids=(token,), pending=0, history=history)


def known(seqs: list[SeqWork], sampled: Container[str]) -> list[SeqWork]:
    """Drop the shares whose pending token nobody sampled: the step that should have
    failed, so the scheduler has ended those sequences."""
    return [w for w in seqs if not w.pending or w.seq_id in sampled]


def resolve_pending(seqs: list[SeqWork], last: Mapping[str, int]) -> list[SeqWork]:
    """On the host: every pending share filled in from `last` (seq id -> the token the
    previous step sampled); shares with no such token are left out."""
    return [fill(w, last[w.seq_id]) if w.pending else w for w in known(seqs, last)]


def pending_rows(seqs: list[SeqWork], slots: Mapping[str, int]) -> dict[int, int]:
    """On the device: share index -> the previous step's sampled slot it reads
    (after `known` has dropped the unresolvable ones)."""
    out = {}
    for i, w in enumerate(seqs):
        if w.pending:
            check(w)
            out[i] = slots[w.seq_id]
    return out
