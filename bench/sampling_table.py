"""What each row of the sampling table costs a user, through HTTP with a streaming client: one stream,
greedy chat, a fixed number of tokens (ignore_eos), completion tokens / request seconds, for plain decoding,
DRY, mirostat, banned strings / regexes (phrases that never match: the watch's cost alone), classifier-free
guidance and the logit lens; llama-server on the same file in the same run for the rows it has (plain, DRY,
mirostat). Then the host-side pieces alone (µs a token): the banned-phrase watch, the guidance row, the lens.

    .venv/bin/python bench/sampling_table.py --llama-server /tmp/llama-cpp-native/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.serving import wait_ready  # noqa: E402

MSGS = [{"role": "system", "content": "You are a helpful assistant who writes plainly."},
        {"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
PHRASES = ["zebra crossing", "quantum chromodynamics", "xylophone", "Zanzibar", "antidisestablishment"]
MODES = {  # name -> (imp's extra fields, llama-server's or None)
    "plain": ({}, {}),
    "DRY 0.8": ({"dry_multiplier": 0.8}, {"dry_multiplier": 0.8}),
    "mirostat 2 (temperature 0.8)": ({"mirostat": 2, "temperature": 0.8, "seed": 1},
                                     {"mirostat": 2, "temperature": 0.8, "seed": 1}),
    "banned_strings x5 (never matching)": ({"banned_strings": PHRASES}, None),
    "banned_regex x2 (never matching)": ({"banned_regex": [r"\bzz+\b", r"[0-9]{12}"]}, None),
    "cfg_scale 2": ({"cfg_scale": 2.0}, None),
    "logit_lens 5": ({"logit_lens": 5}, None),
    "plain (again: the run's noise)": ({}, {}),
}


def stream_rate(url: str, body: dict) -> tuple[float, int]:
    """(completion tokens / seconds from the request to the stream's end, completion tokens). Not the rate of
    content chunks: banned phrases hold text back (a regex 255 bytes), so chunks are not tokens."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"})
    n, t0 = 0, time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                n = (d.get("usage") or {}).get("completion_tokens", n)
    return n / (time.perf_counter() - t0), n


def run_server(cmd, url, modes, tokens, reps, imp: bool):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc, cmd[0])
        out = {}
        for name, extra in modes.items():
            if extra is None:
                continue
            body = {"model": "m", "messages": MSGS, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                    "repetition_penalty": 1.0, **({"speculative": False} if imp else {}), **extra}
            try:
                stream_rate(url, {**body, "max_tokens": 8})  # warm
            except urllib.error.HTTPError as exc:  # this engine refuses it (the lens on a GPU): n/a
                print(f"{name}: HTTP {exc.code} {exc.read()[:160]!r}")
                continue
            rates = [stream_rate(url, body)[0] for _ in range(reps)]
            out[name] = float(np.median(rates))
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def host_pieces() -> list[tuple[str, float]]:
    from imp.core.banned import BanWatch, Texts
    from imp.fetch import resolve_model
    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner
    from imp.sampling.cpu import apply_guidance
    from imp.text.tokenizer import Tokenizer

    path = str(resolve_model("smollm2-135m", progress=False))
    tok = Tokenizer.from_gguf(path)
    out = []
    rng = np.random.default_rng(0)
    if True:  # the watch on SmolLM2's vocabulary
        blob, offs = tok.shown_pieces()
        texts = Texts(blob, np.ascontiguousarray(offs, dtype="<i8").tobytes())
        ids = rng.integers(0, tok.vocab_size, 4000).tolist()
        for name, strings, rx in (("watch: 5 banned strings", PHRASES, ()),
                                  ("watch: 64 banned strings of 40 bytes",
                                   ["x" * 39 + chr(65 + i % 26) for i in range(64)], ()),
                                  ("watch: 2 banned regexes", (), (r"\bzz+\b", r"[0-9]{12}"))):
            w = BanWatch(texts, tuple(strings), tuple(rx))
            t = time.perf_counter()
            for x in ids:
                w.push(x)
                w.safe()
            out.append((name, (time.perf_counter() - t) / len(ids) * 1e6))
    V = 49152
    logits = rng.standard_normal((2, V)).astype(np.float32)
    works = [SeqWork("a#0", (1,), 0, (0,), True, SamplingParams(max_tokens=1, cfg_scale=2.0), guide="a#0.cfg"),
             SeqWork("a#0.cfg", (1,), 0, (1,), True, SamplingParams(max_tokens=1))]
    rows = [logits.copy() for _ in range(200)]
    t = time.perf_counter()
    for x in rows:
        apply_guidance(x, works)
    out.append(("guidance row l_b + s (l_a - l_b), 49,152 ids", (time.perf_counter() - t) / 200 * 1e6))
    r = ModelRunner.load(path, kv_tokens=512)
    resid = rng.standard_normal((r.config.n_layers, r.config.d_model)).astype(np.float32)
    r.model.lens(resid, 5, 5)
    t = time.perf_counter()
    for _ in range(10):
        r.model.lens(resid, 5, 5)
    out.append((f"logit lens of one token ({r.config.n_layers} layers x head)", (time.perf_counter() - t) / 10 * 1e6))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--server-args", default="", help="more imp flags (--device cuda:0)")
    ap.add_argument("--no-pieces", action="store_true", help="skip the host pieces (they load SmolLM2 from the cache)")
    ap.add_argument("--only", default="", help="comma-separated prefixes of the rows to run (default: all)")
    a = ap.parse_args()
    if a.only:
        keep = [m for m in MODES if any(m.startswith(x) for x in a.only.split(","))]
        for m in [m for m in MODES if m not in keep]:
            del MODES[m]
    from imp.fetch import resolve_model

    path = str(resolve_model(a.model, progress=False))
    flags = subprocess.run("lscpu | grep -o 'avx512[a-z_]*\\|avx2\\|amx[a-z_]*' | sort -u | tr '\\n' ' '",
                           shell=True, capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"model {path}\nCPU flags: {flags}\ncommit {commit}, {os.cpu_count()} CPUs, {a.tokens} tokens, "
          f"median of {a.reps}")
    imp = run_server([sys.executable, "-m", "imp", "--model", path, "--port", "8191", "--host", "127.0.0.1",
                      *a.server_args.split()],
                     "http://127.0.0.1:8191", {k: v[0] for k, v in MODES.items()}, a.tokens, a.reps, True)
    peer = {}
    if a.llama_server:
        peer = run_server([a.llama_server, "-m", path, "--port", "8192", "-np", "1", "-c", "4096"],
                          "http://127.0.0.1:8192", {k: v[1] for k, v in MODES.items()}, a.tokens, a.reps, False)
    base = imp["plain"]
    print("\n| sampling | imp tok/s | imp / imp plain | llama-server tok/s (same run) | imp / llama-server |")
    print("|---|---|---|---|---|")
    for name in MODES:
        p, v = peer.get(name), imp.get(name)
        if v is None:
            print(f"| {name} | refused | | | |")
            continue
        print(f"| {name} | {v:.1f} | {v / base:.2f} | {f'{p:.1f}' if p else 'n/a'} | "
              f"{f'{v / p:.2f}' if p else 'n/a'} |")
    pieces = [] if a.no_pieces else host_pieces()
    print("\n| host piece | µs |")
    print("|---|---|")
    for name, us in pieces:
        print(f"| {name} | {us:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"imp": imp, "llama_server": peer, "pieces": pieces, "flags": flags,
                                            "commit": commit}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
