"""Speculation in usage: one table of keys for every dialect (the API reference's six).

When a verify step ran for a request, or it asked for the MTP head and did not get it, its usage
carries imp_spec_drafted / _accepted / _emitted / _verify_steps and, on a decline,
imp_spec_declined + imp_spec_declined_detail: chat and completions in
usage.completion_tokens_details, Anthropic in the top-level usage, Responses in
usage.output_tokens_details. Summed over a request's choices (n > 1).
"""

from __future__ import annotations

DETAIL = {
    "no_mtp_head": "this model file has no MTP head; the n-gram matcher ran as the server runs it",
    "executor_cannot_verify": "this engine does not verify drafts (the server runs with --spec-draft-max 0): "
                              "the request decoded one token a step",
    "banned_phrases": "banned strings or regexes rewind the text the drafter reads: the request decoded one "
                      "token a step",
    "logit_lens": "the logit lens reads every layer of each token's own forward: the request decoded one token a step",
}


class SpecTally:
    """The finished choices' counters of one request."""

    __slots__ = ("drafted", "accepted", "verifies", "declined", "rewinds")

    def __init__(self):
        self.drafted = self.accepted = self.verifies = self.rewinds = 0
        self.declined = ""

    def take(self, d) -> None:
        """Every Delta (or TokenOut) a client gets: each carries the counters of the verifies since its
        choice's one before (imp.core.lifecycle), so a choice a stop string ends keeps what it had."""
        out = getattr(d, "out", d)
        self.drafted += out.spec_drafted
        self.accepted += out.spec_accepted
        self.verifies += out.spec_verify_steps
        self.declined = self.declined or out.spec_declined
        self.rewinds += out.banned_rewinds

    def fields(self) -> dict:
        """The usage keys ({} when nothing speculative happened or was asked, and no banned phrase rewound);
        imp_banned_rewinds: the rewinds banned strings / regexes took (imp.core.banned), when any."""
        u = {"imp_banned_rewinds": self.rewinds} if self.rewinds else {}
        if not self.verifies and not self.declined:
            return u
        u |= {"imp_spec_drafted": self.drafted, "imp_spec_accepted": self.accepted,
             "imp_spec_emitted": self.accepted + self.verifies, "imp_spec_verify_steps": self.verifies}
        if self.declined:
            u["imp_spec_declined"] = self.declined
            u["imp_spec_declined_detail"] = DETAIL.get(self.declined, self.declined)
        return u
