"""Capture replay/concurrent-8.log: 8 concurrent chat requests (half streaming).

    .venv/bin/python replay/capture.py [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def traffic(url: str) -> list[str]:
    import openai

    cl = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(i: int) -> str:
        msgs = [{"role": "user", "content": f"Write {i + 2} words about the number {i}."}]
        kw = dict(model="x", messages=msgs, max_tokens=12 + 4 * i, temperature=0.8, seed=i)
        if i % 2:
            text = ""
            async for ch in await cl.chat.completions.create(stream=True, **kw):
                if ch.choices and ch.choices[0].delta.content:
                    text += ch.choices[0].delta.content
            return text
        return (await cl.chat.completions.create(**kw)).choices[0].message.content

    return await asyncio.gather(*(one(i) for i in range(8)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=str(ROOT / "replay" / "concurrent-8.log"))
    ns = ap.parse_args()
    from tests.serverproc import ServerProcess

    srv = ServerProcess(ns.model, "--kv-cache-tokens", "4096", "--event-log", ns.out)
    try:
        srv.wait_ready()
        for t in asyncio.run(traffic(srv.url)):
            print(repr(t))
    finally:
        srv.stop()
    print(f"wrote {ns.out} ({Path(ns.out).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
