"""The store's counters: what it holds and what it evicted or failed to write.

One `Stats` holds the committed totals (read by the actor's properties, for the
metrics actor); the writer keeps a second one as the delta of the transaction
in flight and adds it only once the COMMIT succeeded, so a rolled-back batch
never shows in the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Stats:
    rows: int = 0  # responses stored now
    bytes: int = 0  # their JSON bytes (responses + input items), what max_bytes limits
    evicted_count: int = 0  # responses evicted because max_responses was reached
    evicted_bytes: int = 0  # responses evicted because max_bytes was reached
    evicted_age: int = 0  # responses evicted because older than max_age_s
    evicted_size: int = 0  # JSON bytes freed by all evictions
    deleted: int = 0  # responses removed by DELETE /v1/responses/{id}
    write_failures: int = 0  # puts/deletes SQLite refused (I/O, disk full, lock timeout)
    read_failures: int = 0  # reads SQLite refused

    def add(self, other: "Stats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
