"""Two CPU backends on one host behind deploy/haproxy.cfg: how they share the cores (docs/DEPLOYMENT.md).

Each layout boots two SmolLM2 servers, measures each alone (4 requests at a time, direct) and both
through HAProxy (8 at a time), and prints the ratio to the sum: pinned to a core each with one
thread (what tests/test_haproxy.py runs), unpinned with one thread each, unpinned with the default
threads (every core each, the forward's governor narrowing under a neighbour).

    .venv/bin/python bench/haproxy_threads.py
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.test_haproxy as lane  # noqa: E402
from imp.fetch import resolve_model  # noqa: E402


class Unpinned(lane.Backend):
    """A backend with its own thread flags and no core of its own."""

    flags: list[str] = []

    def start(self) -> None:
        self.boots += 1
        with open(self.log_dir / f"{self.name}.{self.boots}.out", "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "imp", "--model", str(self.model), "--port", str(self.port), "--agent-port",
                 str(self.agent_port), "--kv-cache-tokens", "8192", "--responses-store", "off", *self.flags],
                cwd=lane.ROOT, stdout=out, stderr=subprocess.STDOUT)


def measure(label: str, make) -> None:
    binary = lane.haproxy_binary()
    d = Path(tempfile.mkdtemp(prefix="imp-threads-"))
    backends = [make(d, i) for i in (1, 2)]
    with lane.serving(binary, backends, d) as proxy:
        asyncio.run(lane.throughput(proxy.url, 8, 8))  # warm
        alone = [asyncio.run(lane.throughput(b.url, 4, 16)) for b in backends]
        both = asyncio.run(lane.throughput(proxy.url, 8, 32))
        print(f"{label}: alone {alone[0]:.1f} + {alone[1]:.1f} tok/s, both through haproxy {both:.1f} tok/s: "
              f"{both / sum(alone):.2f}x the sum", flush=True)


def main() -> None:
    if not lane.haproxy_binary():
        sys.exit("no haproxy (sh deploy/get-haproxy.sh)")
    model = resolve_model("smollm2-135m", progress=False)
    cores = sorted(os.sched_getaffinity(0))

    def unpinned(flags):
        def make(d, i):
            b = Unpinned(model, f"imp{i}", None, d)
            b.flags = flags
            return b
        return make

    measure("pinned, one core and --threads 1 each", lambda d, i: lane.Backend(model, f"imp{i}",
                                                                               cores[(i - 1) % len(cores)], d))
    measure("unpinned, --threads 1 each", unpinned(["--threads", "1", "--fixed-threads"]))
    measure("unpinned, default threads", unpinned([]))


if __name__ == "__main__":
    main()
