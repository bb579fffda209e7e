"""The one error of the constraint layer.

Everything a client can get wrong (a schema llguidance cannot compile, a
regex that does not parse, a spec over our limits, a compile past its
deadline, a sampled token the grammar forbids) is a ConstraintError whose
`reason` is a short human sentence: HTTP turns it into a 400 naming it.
"""

from __future__ import annotations

# llguidance's messages can carry a whole parser-state dump; a 400 body wants the first lines.
MAX_REASON_CHARS = 600


class ConstraintError(ValueError):
    """A constraint cannot be compiled or honoured; `reason` says why."""

    def __init__(self, reason: str):
        reason = " ".join(reason.strip().split()) or "invalid constraint"
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        super().__init__(reason)
        self.reason = reason
