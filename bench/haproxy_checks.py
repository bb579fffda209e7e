"""Which URL HAProxy's check should GET: /health?ready=1 against /ready (docs/DEPLOYMENT.md).

Two SmolLM2 backends, each pinned to one core, behind deploy/haproxy.cfg; the same load through the
file as it is and through a copy whose check is /health?ready=1: how often a backend is out of
rotation (the proxy's view, sampled every 0.25 s), which agent weights it shows, how many requests
fail.

    .venv/bin/python bench/haproxy_checks.py [requests] [width] [max_tokens]   (default 64 8 64)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

import tests.test_haproxy as lane  # noqa: E402
from imp.fetch import resolve_model  # noqa: E402


def main(n: int = 64, width: int = 8, max_tokens: int = 64) -> None:
    binary = lane.haproxy_binary()
    if not binary:
        sys.exit("no haproxy (sh deploy/get-haproxy.sh)")
    d = Path(tempfile.mkdtemp(prefix="imp-checks-"))
    model = resolve_model("smollm2-135m", progress=False)
    cores = sorted(os.sched_getaffinity(0))
    backends = [lane.Backend(model, f"imp{i}", cores[(i - 1) % len(cores)], d) for i in (1, 2)]
    for b in backends:
        b.start()
    for b in backends:
        b.wait_ready()
    text = lane.CFG.read_text()
    variants = {"/ready (deploy/haproxy.cfg)": text,
                "/health?ready=1": text.replace("option httpchk GET /ready", "option httpchk GET /health?ready=1")}
    try:
        for name, cfg_text in variants.items():
            cfg = d / "haproxy.cfg"
            cfg.write_text(cfg_text)
            lane.CFG = cfg
            proxy = lane.Proxy(binary, backends, d)
            proxy.wait_up({"imp1", "imp2"})
            samples = []

            async def run():
                sem = asyncio.Semaphore(width)
                async with aiohttp.ClientSession() as s:
                    async def one(i):
                        async with sem:
                            return await lane.request(s, proxy.url, "chat", i, i % 2 == 0, max_tokens)

                    t = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(n))))
                    while not t.done():
                        samples.append(proxy.servers())
                        await asyncio.sleep(0.25)
                    return await t

            out = asyncio.run(run())
            failed = sum(not o.ok for o in out)
            out_of = sum(not all(v["up"] for v in view.values()) for view in samples)
            weights = sorted({v["weight"] for view in samples for v in view.values()})
            print(f"check {name}: {failed} of {n} failed; a backend out of rotation in {out_of} of "
                  f"{len(samples)} samples; agent weights {weights}")
            proxy.stop()
            time.sleep(1)
    finally:
        for b in backends:
            b.stop(signal.SIGKILL)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
