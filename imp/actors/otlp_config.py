"""The OTLP exporter's configuration: read once at boot from the flags and the OpenTelemetry
environment variables, then frozen. Apart from the actor (imp/actors/otlp.py) so a server
that exports nothing never imports the OpenTelemetry SDK (~6 MB of the process, psutil
included)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

DEFAULT_SERVICE_NAME = "imp-server"


@dataclass(frozen=True)
class OtlpConfig:
    """Read once at boot (`resolve`), then frozen."""

    endpoint: str = ""  # full OTLP/HTTP traces URL; "" = export nothing
    service_name: str = DEFAULT_SERVICE_NAME
    log_requests: str = ""  # JSONL path; "" = no request log
    timeout_s: float = 10.0  # one export request, retries included
    schedule_delay_ms: float = 1000.0  # batch period

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint or self.log_requests)

    @classmethod
    def resolve(cls, otlp_endpoint: str | None, log_requests: str | None, environ: Mapping[str, str]) -> "OtlpConfig":
        """--otlp-endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (a full URL), else
        OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces (the spec's base-URL form); the service
        name from OTEL_SERVICE_NAME; the export timeout from OTEL_EXPORTER_OTLP_TRACES_TIMEOUT
        (seconds, as the Python SDK reads it)."""
        endpoint = otlp_endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        if not endpoint and environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        endpoint = endpoint.strip()
        if endpoint and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--otlp-endpoint must be an http(s):// URL of an OTLP/HTTP traces receiver, "
                             f"got {endpoint!r}")
        timeout = environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")
        try:
            timeout_s = float(timeout) if timeout else cls.timeout_s
        except ValueError as exc:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT must be a number of seconds, got {timeout!r}") from exc
        return cls(endpoint=endpoint, service_name=environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME,
                   log_requests=log_requests or "", timeout_s=timeout_s)
