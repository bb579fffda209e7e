"""The Responses store's configuration: read once at boot, frozen, validated."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_FILENAME = "responses.sqlite3"  # under the cache dir unless --responses-store names a path
SYNCHRONOUS = ("NORMAL", "FULL")


@dataclass(frozen=True)
class StoreConfig:
    path: str
    # limits; 0 = none. Past one, the oldest responses are evicted (by insertion order;
    # by created_at for the age limit), and each eviction is counted by its reason.
    max_responses: int = 10_000
    max_bytes: int = 1 << 30  # response JSON + input items JSON, summed over the store
    max_age_s: float = 30 * 86400.0  # OpenAI keeps stored responses 30 days
    max_chain: int = 1000  # previous_response_id links followed; a longer chain is refused
    # WAL + NORMAL: a committed write survives the process dying (SIGTERM, SIGKILL, OOM);
    # only an OS crash or power cut can lose the last commits. FULL fsyncs every batch.
    synchronous: str = "NORMAL"
    busy_timeout_s: float = 5.0  # a write waits this long for a lock someone else holds
    open_timeout_s: float = 2.0  # at boot: a lock held this long is a start-up error
    batch_max: int = 64  # requests the writer takes per transaction (group commit)
    integrity_check: bool = True  # PRAGMA quick_check at boot (reads the whole file once)

    def __post_init__(self):
        checks = [
            (bool(str(self.path).strip()), "--responses-store: empty path"),
            (self.max_responses >= 0, "--responses-store-max-responses must be >= 0 (0 = no limit)"),
            (self.max_bytes >= 0, "--responses-store-max-bytes must be >= 0 (0 = no limit)"),
            (self.max_age_s >= 0, "--responses-store-max-age must be >= 0 (0 = no limit)"),
            (1 <= self.max_chain <= 10_000, "responses store max_chain must be 1..10000"),
            (self.synchronous in SYNCHRONOUS, f"responses store synchronous must be one of {SYNCHRONOUS}"),
            (self.busy_timeout_s > 0 and self.open_timeout_s > 0, "responses store timeouts must be > 0"),
            (1 <= self.batch_max <= 4096, "responses store batch_max must be 1..4096"),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)
