"""What a failed step means for the engine, and the fault-injection hook.

A step that raises on the host (a bug, a bad shape, host OOM) fails its requests
(`engine_step_failed`) and the engine goes on. A device fault (an illegal address,
a launch failure, a device-side assert) poisons the CUDA context: every later step
would fail too, so the executor stops and reports a `Fault`; every in-flight
request ends `engine_faulted`, /health and /ready answer 503 engine_faulted, and no
request after it is queued. `is_device_fault` decides which is which, in one place.

`FaultPlan` is how tests exercise those paths on purpose: IMP_FAULT_INJECT, read
once at boot (imp.server), as "step@N" (the N-th step raises once, host side) or
"device@N" (the N-th step raises a device fault). Steps count from 1.
"""

from __future__ import annotations

from dataclasses import dataclass

# the CUDA errors that leave the context unusable (CUDA runtime/driver names and texts)
_STICKY = (
    "illegal memory access", "illegal address", "unspecified launch failure", "misaligned address",
    "device-side assert", "cudaerrorillegaladdress", "cudaerrorlaunchfailure", "cuda_error_illegal_address",
    "cuda_error_launch_failed", "cudaerrorassert", "cudaerrorhardwarestackerror", "cudaerrorillegalinstruction",
)


class DeviceFault(RuntimeError):
    """A fault that poisons the device (raised by the injection hook; real ones are
    recognised by their text)."""


def is_device_fault(exc: BaseException) -> bool:
    if isinstance(exc, DeviceFault):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(s in text for s in _STICKY)


@dataclass(frozen=True)
class FaultPlan:
    kind: str  # "step" or "device"
    at_step: int

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan | None:
        if not spec:
            return None
        kind, _, at = spec.partition("@")
        if kind not in ("step", "device") or not at.isdigit() or int(at) < 1:
            raise ValueError(f"IMP_FAULT_INJECT must be step@N or device@N (N >= 1), got {spec!r}")
        return cls(kind, int(at))

    def check(self, step: int) -> None:
        """Called before the executor's step number `step` (1, 2, ...) runs."""
        if step != self.at_step:
            return
        if self.kind == "device":
            raise DeviceFault("injected device fault: an illegal memory access was encountered")
        raise RuntimeError(f"injected step failure at step {step}")
