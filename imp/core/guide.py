"""Classifier-free guidance in the scheduler: a choice (params.cfg_scale > 1) has a shadow sequence
that decodes the same generated tokens after another prompt (Submit.cfg_prompt). The runner samples
the choice's row from l_b + s (l_a - l_b), l_b the shadow's logits at the same generated index, so
the two must reach that index in one step: the choice samples only in a step where its shadow's share
ends there too (SeqWork.guide names it). Otherwise each computes its prompt on its own, one token
short of its end, and a choice whose shadow is not running (waiting, preempted) or whose token is in
flight (pipelined) sits out. The shadow never samples for itself: its tokens are the choice's.

Pure helpers over the scheduler's state (imp.core.schedstate); the scheduler calls them."""

from __future__ import annotations

from imp.core.schedstate import Seq, Status, Work


def paired_share(s: Seq, start: int, vlen: int, n: int, budget: int, slots: int) -> tuple[int, int, bool]:
    """For choice `s` whose share would compute positions start .. start+n-1 of its vlen known ones (within
    `budget` tokens and `slots` free batch rows): (the choice's n, its shadow's n, whether both sample)."""
    g = s.shadow
    if g.status is not Status.RUNNING or s.pending or g.pending:  # nothing of the pair samples this step
        return min(n, vlen - start - 1), 0, False
    gstart = g.num_computed + g.ahead
    left = len(g.tokens) - gstart  # the shadow's positions still to compute (>= 1: it never takes its last alone)
    if start + n == vlen and left <= budget - n and slots >= 2:
        return n, left, True
    n = min(n, vlen - start - 1)
    gn = max(0, min(left - 1, budget - n))
    return n, gn if slots >= (n > 0) + (gn > 0) else 0, False


def unpaired(batch: list[Work]) -> set[Seq]:
    """Sequences of `batch` whose sampling share lost its partner (the allocator refused one of the two, or
    one was preempted): both must sit the step out, or the choice would sample without its l_b (and a shadow
    that computed its last position alone would have none left to pair with)."""
    sampling = {w.seq for w in batch if w.sample}
    lost = set()
    for w in batch:
        if w.sample and w.seq.shadow is not None and w.seq.shadow not in sampling:
            lost.add(w.seq)
        elif w.sample and w.seq.guided is not None and w.seq.guided not in sampling:
            lost.add(w.seq)
    return lost
