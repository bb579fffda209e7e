"""Our tokenizer against llama.cpp's on the same GGUF: every text of tests/test_tokenizer.py's
corpus plus edge cases (whitespace runs, scripts, emoji, chat-template specials, a source
file), encoded with and without special-token parsing, through llama-server's /tokenize.

    PYTHONPATH=. .venv/bin/python bench/tokenize_vs_llama.py \\
        --llama-server /tmp/llama-cpp/build/bin/llama-server --models smollm2-135m,gemma-3-270m

Prints one line per model (and each differing text). llama.cpp: bench/llama_cpp.sh.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from imp.fetch import resolve_model
from imp.text.tokenizer import Tokenizer
from tests.serverproc import free_port
from tests.test_tokenizer import CORPUS

EDGES = ["  leading", "trailing  ", "a\n\nb\t\tc", "数字 123456 ١٢٣", "emoji 🙂🙃 x",
         "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>", "ÀÉÎÕÜ àéîõü", "   ", "\n",
         "x" * 300, (Path(__file__).parent.parent / "imp" / "http" / "score.py").read_text()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    args = ap.parse_args()
    texts = list(CORPUS) + EDGES
    for name in args.models.split(","):
        path = resolve_model(name)
        tok = Tokenizer.from_gguf(path)
        port = free_port()
        p = subprocess.Popen([args.llama_server, "-m", path, "--port", str(port), "-t", "2"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.3)
            diff = 0
            for t in texts:
                for special in (False, True):
                    body = json.dumps({"content": t, "add_special": False, "parse_special": special}).encode()
                    req = urllib.request.Request(url + "/tokenize", body, {"Content-Type": "application/json"})
                    ref = json.load(urllib.request.urlopen(req, timeout=60))["tokens"]
                    ours = tok.encode(t, parse_special=special)
                    if ref != ours:
                        diff += 1
                        print(f"  differs ({name}, parse_special={special}): {t[:40]!r}: {ref[:12]} vs {ours[:12]}")
            print(f"{name}: {len(texts) * 2} encodes, {diff} differ from llama.cpp")
        finally:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
