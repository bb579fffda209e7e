"""Which models stay resident: the memory budget's decisions, pure (no clock, no I/O).

The fleet (imp.engine.fleet) asks two questions and carries out the answers:
- `plan_load`: a model that is not resident is wanted; which resident models must go first so that it
  fits --models-memory (device, and host where a GPU holds the weights)? Idle ones first, least
  recently used first; a busy one only when the idle ones do not free enough (it is drained, never
  cancelled). A model larger than the budget on its own is refused outright.
- `idle_victims`: which resident models have been idle past their idle-unload time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Footprint:
    """Bytes a resident model holds: on the executor's device (the GPU's memory; 0 on a CPU server) and
    in host memory (a CPU server's weights and KV; a GPU server's pinned swap area and text side)."""

    device: int = 0
    host: int = 0

    def __add__(self, o: "Footprint") -> "Footprint":
        return Footprint(self.device + o.device, self.host + o.host)


@dataclass(frozen=True)
class Budget:
    """--models-memory: bytes the resident models may hold together; 0 = no limit on that side."""

    device: int = 0
    host: int = 0

    def over(self, used: Footprint) -> bool:
        return (self.device > 0 and used.device > self.device) or (self.host > 0 and used.host > self.host)

    def describe(self, f: Footprint) -> str:
        parts = []
        if self.device:
            parts.append(f"{f.device / 2**30:.2f} GiB of device memory (budget {self.device / 2**30:.2f})")
        if self.host:
            parts.append(f"{f.host / 2**30:.2f} GiB of host memory (budget {self.host / 2**30:.2f})")
        return " and ".join(parts)


@dataclass(frozen=True)
class Resident:
    name: str
    footprint: Footprint
    last_used: float  # the fleet's clock, seconds; only the order matters here
    busy: bool = False  # requests hold it now: unloading it waits for them
    idle_unload_s: float = 0.0  # 0: never unloaded for idleness


@dataclass(frozen=True)
class Plan:
    fits: bool
    evict: tuple[str, ...] = ()  # in this order
    why: str = ""  # fits=False: what the budget cannot hold


def plan_load(want: str, need: Footprint, residents: list[Resident], budget: Budget) -> Plan:
    """The models to unload before `want` (needing `need`) loads, or a refusal when it cannot fit at all."""
    if budget.over(need):
        return Plan(False, why=f"model {want!r} needs {budget.describe(need)}: more than --models-memory allows "
                                "with every other model unloaded")
    others = [r for r in residents if r.name != want]
    used = need
    for r in others:
        used = used + r.footprint
    order = sorted(others, key=lambda r: (r.busy, r.last_used, r.name))  # idle first, least recently used first
    evict = []
    for r in order:
        if not budget.over(used):
            break
        evict.append(r.name)
        used = Footprint(used.device - r.footprint.device, used.host - r.footprint.host)
    return Plan(True, tuple(evict))


def idle_victims(now: float, residents: list[Resident]) -> tuple[str, ...]:
    """Resident models with nothing running whose idle-unload time has passed since their last use."""
    return tuple(r.name for r in sorted(residents, key=lambda r: r.last_used)
                 if r.idle_unload_s > 0 and not r.busy and now - r.last_used >= r.idle_unload_s)
