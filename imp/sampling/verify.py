"""A verify share's samples: the draft kept up to the first position that samples otherwise.

A share with `draft = d` fed the sequence's last token and d guessed ones; the forward gave
logits after each of the d + 1 (rows [d+1, vocab]). Position j is sampled exactly as a decode
step at that point would sample it: the same processing, uniform(seed, gen_index + j), the
history with the draft's first j tokens (which, up to j, are the tokens the sequence generated).
Draft token j is kept while it equals that sample; the first sample that differs (or the one
after the whole draft) ends the share. So the tokens are those of decoding one at a time, for
greedy and seeded sampling alike: with a guess that is a single token (no draft distribution),
"keep it when the sample equals it" accepts it with probability p(guess) and otherwise yields a
token drawn from p without it, which is the standard speculative rejection rule for a
deterministic draft; the output distribution is unchanged, and so is each seed's output.

Grammars: position j's row is masked for the grammar's state after the history and the draft's
first j tokens (the book syncs the sequence's matcher to exactly that, rolling back as needed),
so a draft token the grammar forbids there is never sampled: the draft ends at it.
"""

from __future__ import annotations

import msgspec
import numpy as np

from imp.messages import SampledToken, SeqWork
from imp.sampling.cpu import sample_one


def drafts(w: SeqWork) -> tuple[int, ...]:
    return tuple(w.token_ids[len(w.token_ids) - w.draft:]) if w.draft else ()


def kept(drawn: list[SampledToken], draft: tuple[int, ...]) -> SampledToken:
    """Each position's draw (len(draft) + 1 of them) -> the first that differs from the draft (or the one after
    it), the draws before it in `accepted`."""
    j = 0
    while j < len(draft) and drawn[j].token_id == draft[j]:
        j += 1
    return msgspec.structs.replace(drawn[j], accepted=tuple(drawn[:j]))


def verify(rows, w: SeqWork, constraints=None) -> SampledToken:
    """rows [draft+1, vocab] fp32 (any array numpy reads; a constrained share's are masked in
    place, one by one) -> the last token sampled, its kept draft tokens in `accepted`.
    constraints: the executor's ConstraintBook (imp.constrain.book), for a constrained share."""
    rows = np.asarray(rows)
    d = drafts(w)
    if w.params.plain_greedy:  # every position an argmax: one op
        ids = np.argmax(rows, axis=-1).tolist()
        j = 0
        while j < len(d) and ids[j] == d[j]:
            j += 1
        kept = tuple(SampledToken(w.seq_id, t) for t in d[:j])
        return SampledToken(w.seq_id, ids[j], accepted=kept)
    kept: list[SampledToken] = []
    hist = tuple(w.history) if w.params.needs_history else ()
    mu = w.mu  # mirostat: each position's state is the one after the kept draft before it
    for j in range(len(d) + 1):
        wj = w if j == 0 else msgspec.structs.replace(w, gen_index=w.gen_index + j, history=hist + d[:j] if
                                                      w.params.needs_history else (), mu=mu)
        if constraints is not None and w.params.constrained:
            constraints.apply(rows[j:j + 1], [wj])
        t = sample_one(rows[j], wj)
        mu = t.mu
        if j < len(d) and t.token_id == d[j]:
            kept.append(t)
            continue
        return msgspec.structs.replace(t, accepted=tuple(kept))
    raise AssertionError("unreachable")
