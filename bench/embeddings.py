"""Sentence embeddings: imp's /v1/embeddings through HTTP against HF transformers in process.

    PYTHONPATH=. .venv/bin/python bench/embeddings.py [--texts 512] [--batch 32] [--clients 1,4]

Starts `python -m imp --embedding-model all-minilm-l6-v2` (SmolLM2 as the chat model, idle),
posts the texts in batches from C concurrent clients, and prints texts/s and tokens/s beside
transformers' AutoModel + mean pooling + normalize on the same texts, same batch size, torch
with the same thread count (the peer: what a Python user would otherwise run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the a cat dog runs sits on mat park server model token stream fast slow memory kernel "
         "tensor batch query document search rank vector space meaning sentence river mountain").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 48))) for _ in range(n)]


async def through_http(url: str, data: list[str], batch: int, clients: int) -> float:
    import aiohttp

    chunks = [data[i:i + batch] for i in range(0, len(data), batch)]
    q: asyncio.Queue = asyncio.Queue()
    for c in chunks:
        q.put_nowait(c)

    async def worker(s):
        while not q.empty():
            c = q.get_nowait()
            async with s.post(url + "/v1/embeddings", json={"model": "m", "input": c, "encoding_format": "base64"}) as r:
                assert r.status == 200, await r.text()
                await r.read()

    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/embeddings", json={"model": "m", "input": data[:batch]}) as r:  # warm
            await r.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(clients)))
        return time.perf_counter() - t0


def transformers_peer(path: Path, data: list[str], batch: int, threads: int) -> float:
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(threads)
    tok, model = AutoTokenizer.from_pretrained(str(path)), AutoModel.from_pretrained(str(path)).eval()

    def run(chunk):
        enc = tok(chunk, padding=True, return_tensors="pt")
        with torch.inference_mode():
            h = model(**enc).last_hidden_state
        m = enc["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    run(data[:batch])
    t0 = time.perf_counter()
    for i in range(0, len(data), batch):
        run(data[i:i + batch])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from imp.fetch import resolve_model
    from imp.model.bert import BertEncoder
    from tests.serverproc import ServerProcess

    path = resolve_model("all-minilm-l6-v2")
    data = texts(args.texts)
    ntok = sum(len(x) for x in BertEncoder.load(path).tokenize(data))
    rows = []
    with ServerProcess(resolve_model("smollm2-135m"), "--embedding-model", str(path), "--kv-cache-tokens", "2048",
                       "--threads", str(args.threads)) as srv:
        for c in (int(x) for x in args.clients.split(",")):
            dt = asyncio.run(through_http(srv.url, data, args.batch, c))
            rows.append((f"imp /v1/embeddings, {c} client(s)", dt))
    rows.append((f"transformers in process (torch, {args.threads} threads)",
                 transformers_peer(path, data, args.batch, args.threads)))
    print(f"\n{args.texts} texts ({ntok} tokens with [CLS]/[SEP]), batches of {args.batch}, all-MiniLM-L6-v2\n")
    print("| what | seconds | texts/s | tokens/s |\n|---|---|---|---|")
    for name, dt in rows:
        print(f"| {name} | {dt:.2f} | {args.texts / dt:.0f} | {ntok / dt:.0f} |")


if __name__ == "__main__":
    main()
