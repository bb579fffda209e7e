"""Write tests/data/dry_reference.json: llama.cpp's DRY sampler (tests/tools/dry_ref.cpp, linked against a
llama.cpp build) on SmolLM2's vocabulary, fixed contexts and seeded random logits; tests/test_dry.py holds
imp.sampling.dry to it.

    g++ -O1 -std=c++17 tests/tools/dry_ref.cpp -I$L/src/include -I$L/src/ggml/include $L/build/src/libllama.a \\
        $L/build/ggml/src/libggml.a $L/build/ggml/src/libggml-cpu.a $L/build/ggml/src/libggml-base.a \\
        -lpthread -lgomp -ldl -o /tmp/dry_ref            # L: a llama.cpp tree built by bench/llama_cpp.sh
    .venv/bin/python tests/tools/dry_reference.py /tmp/dry_ref
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TEXT = ("The cat sat on the mat. The cat sat on the mat. The cat sat on the hat: the cat sat on\n"
        "* item one is here\n* item one is here\n* item one is\n"
        "def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(x):\n    return x")
CASES = [  # mult, base, allowed, last_n, breakers, context (TEXT's first `end` tokens), logits seed
    dict(mult=0.8, base=1.75, allowed=2, last_n=64, breakers=["\n", ":", "\"", "*"], end=18, seed=1),
    dict(mult=0.8, base=1.75, allowed=2, last_n=64, breakers=["\n", ":", "\"", "*"], end=19, seed=2),
    dict(mult=0.8, base=1.75, allowed=2, last_n=64, breakers=["\n", ":", "\"", "*"], end=25, seed=3),
    dict(mult=1.5, base=2.0, allowed=1, last_n=64, breakers=["\n", ":", "\"", "*"], end=41, seed=4),
    dict(mult=1.5, base=2.0, allowed=1, last_n=200, breakers=[], end=41, seed=5),
    dict(mult=1.0, base=1.1, allowed=3, last_n=200, breakers=["###"], end=66, seed=6),
    dict(mult=2.0, base=3.0, allowed=2, last_n=12, breakers=["sat on the"], end=18, seed=7),
    dict(mult=2.0, base=3.0, allowed=2, last_n=200, breakers=["sat on the"], end=25, seed=8),
    dict(mult=0.5, base=1.75, allowed=0, last_n=1000, breakers=["return x"], end=None, seed=9),
    dict(mult=3.0, base=100.0, allowed=0, last_n=1000, breakers=["zzz"], end=66, seed=10),
    dict(mult=0.8, base=1.75, allowed=2, last_n=64, breakers=["\n", ":", "\"", "*"], end=None, seed=11),
]


def main() -> int:
    harness = sys.argv[1]
    from imp.fetch import resolve_model
    from imp.text.tokenizer import Tokenizer

    model = resolve_model("smollm2-135m", progress=False)
    tok = Tokenizer.from_gguf(model)
    ids = tok.encode(TEXT)
    V = tok.vocab_size
    out = {"model": "smollm2-135m", "text": TEXT, "cases": []}
    for c in CASES:
        ctx = ids[:c["end"]] if c["end"] else ids
        logits = np.random.default_rng(c["seed"]).standard_normal(V).astype(np.float32)
        stdin = "\x1f".join(b.replace("\n", "\\n") for b in c["breakers"]) + "\n" + " ".join(map(str, ctx)) + "\n" + \
            " ".join(repr(float(x)) for x in logits) + "\n"
        r = subprocess.run([harness, str(model), str(c["mult"]), str(c["base"]), str(c["allowed"]), str(c["last_n"])],
                           input=stdin, capture_output=True, text=True, check=True)
        got = np.array([float(x) for x in r.stdout.split()], np.float32)
        assert got.shape == logits.shape
        diff = np.nonzero(got != logits)[0]
        out["cases"].append({**c, "context": ctx, "penalized": {int(i): float(got[i]) for i in diff}})
        print(c, "->", len(diff), "tokens penalized", file=sys.stderr)
    (ROOT / "tests" / "data" / "dry_reference.json").write_text(json.dumps(out, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
