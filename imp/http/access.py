"""Who may call, and how often: API keys and the per-key rate limit.

Keys come from --api-key and --api-key-file (one per line, '#' comments), read
once at boot (`load_api_keys`). Every route but the probes (/health, /ready) and
the UI's static page needs one, as `Authorization: Bearer KEY` (OpenAI SDKs,
Codex) or `x-api-key: KEY` (Anthropic SDKs, Claude Code). A wrong or missing key
is 401 in the route's dialect (Anthropic: authentication_error).

--rate-limit N: N requests per minute per key (per client address when the server
has no keys), across every dialect and route behind the key; a token bucket that
holds N, so a burst of N passes and then one request per 60/N s. Past it: 429
rate_limit_exceeded with Retry-After. `RateLimiter.take` is pure: the time comes in.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass, field
from pathlib import Path

MAX_BUCKETS = 10_000  # distinct callers remembered; the idlest are forgotten past it


def load_api_keys(api_key: str | None, api_key_file: str | None) -> tuple[str, ...]:
    keys = [api_key] if api_key else []
    if api_key_file:
        try:
            text = Path(api_key_file).read_text()
        except OSError as exc:
            raise ValueError(f"--api-key-file {api_key_file}: {exc.strerror or exc}") from None
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
        if not keys:
            raise ValueError(f"--api-key-file {api_key_file} holds no key")
    return tuple(dict.fromkeys(keys))


def presented_key(headers) -> str:
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key", "").strip()


def key_matches(got: str, keys: tuple[str, ...]) -> str | None:
    """The key that matches (compared in constant time against every key), or None."""
    found = None
    for k in keys:
        if hmac.compare_digest(got.encode(), k.encode()):
            found = k
    return found


@dataclass
class RateLimiter:
    per_minute: int
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # caller -> (tokens, at)

    def take(self, caller: str, now: float) -> float:
        """Spend one request of `caller` at time `now` (seconds); 0.0 if allowed, else the
        seconds until one is."""
        rate = self.per_minute / 60.0
        tokens, at = self.buckets.pop(caller, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - at) * rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / rate
        self.buckets[caller] = (tokens, now)  # most recent last: the oldest go first
        if len(self.buckets) > MAX_BUCKETS:
            del self.buckets[next(iter(self.buckets))]
        return wait


def retry_after(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))
