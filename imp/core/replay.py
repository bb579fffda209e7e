"""`python -m imp replay LOG`: re-run the decision cores from a recorded log.

Each core (admission, scheduler, kv) is pure: its outputs are a function of
its config and its inputs, in order. Replay rebuilds every core from the
configs in the log header, feeds it the messages the log says it received,
and compares each message it emits with the one the log recorded, in order.
No model is loaded. The first divergence is printed with the sequence number
of the recorded message and the run exits 1.

Before comparing anything it checks that the log is whole and is the model's
it claims: sequence numbers run without a gap (a lost record would make a
core diverge for no fault of its own), the header's model fingerprint is the
one every KV allocator was built with, and, when the caller names the model
(`python -m imp replay LOG --model PATH`), that it is that model's. Logs of
an older schema are upcast on read (`imp.log.upcast`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import msgspec

from imp.log.eventlog import LogHeader, read_log
from imp.messages import Fault


def core_types():
    from imp.core.admission import AdmissionConfig, AdmissionCore
    from imp.core.kv import KvConfig, KvCore
    from imp.core.scheduler import SchedulerConfig, SchedulerCore

    return {
        "admission": (AdmissionCore, AdmissionConfig),
        "scheduler": (SchedulerCore, SchedulerConfig),
        "kv": (KvCore, KvConfig),
    }


class LogRefused(ValueError):
    """The log cannot be replayed as it is: say why, compare nothing."""


def check_header(header: LogHeader, expect_fingerprint: str | None = None) -> None:
    kv_fps = {name: cfg.get("fingerprint") for name, cfg in header.configs.items() if name.split(".")[0] == "kv"}
    for name, fp in kv_fps.items():
        if fp is not None and fp != header.fingerprint:
            raise LogRefused(f"the header's model fingerprint {header.fingerprint[:16]} is not the one {name} was "
                             f"built with ({str(fp)[:16]}): the log is inconsistent")
    if expect_fingerprint is not None and expect_fingerprint != header.fingerprint:
        raise LogRefused(f"the log was written with model {header.fingerprint[:16]}..., not this model "
                         f"({expect_fingerprint[:16]}...): refusing to replay it against another model")


@dataclass
class Divergence:
    seq: int
    core: str
    expected: str
    got: str


@dataclass
class ReplayResult:
    events: int = 0
    inputs: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    divergence: Divergence | None = None
    seconds: float = 0.0


def _show(receiver: str, msg) -> str:
    return f"-> {receiver}: {msgspec.json.encode(msg).decode()[:400]}"


def replay(header: LogHeader, envelopes, *, step_print=None) -> ReplayResult:
    from imp.core.replicas import Routed, split_name

    types = core_types()
    cores = {}
    for name, cfg in header.configs.items():  # "scheduler.1": replica 1 of a data-parallel engine
        base, index = split_name(name)
        if base in types:
            cls, cfg_cls = types[base]
            core = cls(msgspec.convert(cfg, cfg_cls))
            cores[name] = core if index is None else Routed(core, index)
    pending: dict[str, list] = {name: [] for name in cores}  # emitted, not yet matched
    res = ReplayResult(inputs={n: 0 for n in cores}, decisions={n: 0 for n in cores})
    t0 = time.perf_counter()
    last_seq = None
    for env in envelopes:
        if last_seq is not None and env.seq != last_seq + 1:
            raise LogRefused(f"sequence gap: seq {env.seq} follows seq {last_seq} "
                             f"({env.seq - last_seq - 1} record(s) missing)")
        last_seq = env.seq
        res.events += 1
        # a recorded output of a core: the replayed core must have emitted the same
        if env.sender in cores and not isinstance(env.payload, Fault):
            queue = pending[env.sender]
            want = (env.receiver, env.payload)
            if not queue:
                res.divergence = Divergence(env.seq, env.sender, _show(*want), "(nothing emitted)")
                break
            got = queue.pop(0)
            if got != want:
                res.divergence = Divergence(env.seq, env.sender, _show(*want), _show(*got))
                break
            res.decisions[env.sender] += 1
            if step_print:
                step_print(f"{env.seq:>8} step {env.step:<6} {env.sender} {_show(*got)}  ok")
        # a recorded input of a core: feed it
        if env.receiver in cores:
            res.inputs[env.receiver] += 1
            outs = cores[env.receiver].handle(env.sender, env.payload)
            pending[env.receiver].extend(outs)
    res.seconds = time.perf_counter() - t0
    return res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m imp replay", description=__doc__.splitlines()[0])
    p.add_argument("log", help="event log written with --event-log (or a ring dump)")
    p.add_argument("--step", action="store_true", help="print every decision as it is checked")
    p.add_argument("--model", default=None, help="refuse the log unless it was written with this model")
    return p


def main(argv: list[str] | None = None, expect_fingerprint: str | None = None) -> int:
    """expect_fingerprint: the --model's fingerprint, computed by the caller (python -m imp
    replay), which can read model files; this module reads only logs."""
    ns = parser().parse_args(argv)
    try:
        header, envs = read_log(ns.log)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        print(f"replay: cannot read {ns.log}: {exc}", file=sys.stderr)
        return 2
    print(f"log: {ns.log}  schema v{header.schema_version}  model fingerprint {header.fingerprint[:16]}  {header.note}")
    try:
        check_header(header, expect_fingerprint)
        res = replay(header, envs, step_print=print if ns.step else None)
    except LogRefused as exc:
        print(f"replay: refused: {exc}", file=sys.stderr)
        return 2
    for name in res.inputs:
        print(f"  {name:<10} {res.inputs[name]:>8} inputs  {res.decisions[name]:>8} decisions checked")
    rate = res.events / res.seconds if res.seconds else float("inf")
    if res.divergence:
        d = res.divergence
        print(f"DIVERGENCE at seq {d.seq} ({d.core}):")
        print(f"  expected {d.expected}")
        print(f"  got      {d.got}")
        return 1
    print(f"replay: {res.events} events in {res.seconds:.3f}s ({rate:,.0f} events/s): identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
