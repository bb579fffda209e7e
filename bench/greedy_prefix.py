"""Greedy agreement with llama.cpp, against HF transformers fp32's own agreement (issue 15 §5).

The same prompt tokens (a dozen varied chat turns rendered by imp's template) go to imp
(/v1/completions, token-id prompt), llama-server (same route, same ids) and HF transformers
(`gguf_file=`, dequantized to fp32); each continues greedily for --tokens tokens with no
penalty. Per prompt: the common prefix (characters of text) of imp vs llama.cpp and of HF vs
llama.cpp. imp's should be at least HF's: llama.cpp and HF both run the file's weights, so
where HF fp32 already departs from llama.cpp (near-ties) nobody is expected to follow.

    .venv/bin/python bench/greedy_prefix.py --model gemma-3-270m --llama-server /tmp/llama-cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three prime numbers greater than 50.", "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.", "Why is the sky blue?", "Give me a recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in two sentences.", "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.", "Tell me a short joke about computers.",
]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from imp.fetch import resolve_model
    from imp.formats.gguf_loader import open_gguf
    from imp.server import text_parts
    from imp.config import ServerConfig
    from bench.serving import wait_ready
    from tests.serverproc import free_port

    path = resolve_model(a.model)
    tok, template = text_parts(ServerConfig(), path, open_gguf(str(path)).metadata)
    prompts = [template.render_and_encode(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    body = lambda ids: {"model": "m", "prompt": ids, "max_tokens": a.tokens, "temperature": 0,  # noqa: E731
                        "repetition_penalty": 1.0, "repeat_penalty": 1.0, "top_k": 1}
    outs: dict[str, list[str]] = {}
    for name, cmd in (("imp", [sys.executable, "-m", "imp", "--model", str(path), "--threads", str(a.threads)]),
                      ("llama.cpp", [a.llama_server, "-m", str(path), "-t", str(a.threads), "-c", "4096"])):
        port = free_port()
        proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=Path(__file__).resolve().parent.parent)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, name)
            outs[name] = [post(f"http://127.0.0.1:{port}/v1/completions", body(ids))["choices"][0]["text"]
                          for ids in prompts]
        finally:
            proc.terminate()
            proc.wait(30)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs["hf"] = []
    with torch.inference_mode():
        for ids in prompts:
            g = hf.generate(torch.tensor([ids]), max_new_tokens=a.tokens, do_sample=False)[0, len(ids):].tolist()
            outs["hf"].append(tok.decode(g))
    print(f"\n{path.name}, {a.tokens} greedy tokens, common prefix with llama.cpp (characters)")
    print("| prompt | imp vs llama.cpp | HF fp32 vs llama.cpp | imp vs HF fp32 | output length (llama.cpp) |")
    print("|---|---|---|---|---|")
    ti = th = tih = 0
    for p, i, l, h in zip(PROMPTS, outs["imp"], outs["llama.cpp"], outs["hf"]):
        ci, ch, cih = common(i, l), common(h, l), common(i, h)
        ti, th, tih = ti + ci, th + ch, tih + cih
        print(f"| {p[:40]} | {ci} | {ch} | {cih} | {len(l)} |")
    print(f"| **total** | **{ti}** | **{th}** | **{tih}** | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
