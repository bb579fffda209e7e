"""What llguidance's slices cost in memory and buy in mask time, on a model's own vocabulary.

    PYTHONPATH=. .venv/bin/python bench/constrain_slices.py --model gemma-3-270m

Each slice set is built in a fresh process (llguidance's allocations overlap between builds
in one process, so a second build's figure is not its own), after one tiny build that sets up
llguidance's one-time state. Memory: the anonymous RSS the LLTokenizer adds (collected and
malloc_trim'd before and after). Masks: a fresh matcher's first mask (llguidance caches a
state's mask, so a repeated one is ~3 us whatever the slices), median of 30, after a prefix
of a JSON object of a string, a maxLength-40 string and an integer, in four contexts, with
whitespace strict (as forced tool calls and schemas run) and flexible.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONFIGS = ("default", "ws,30", "30", "none")  # imp.constrain.vocab.DEFAULT_SLICES is "30"
CONTEXTS = ("string", "maxLength 40", "integer", "key")
PREFIXES = {
    False: ('{"a":"hel', '{"a":"x","b":"ab', '{"a":"x","b":"y","c":1', '{"a":"x",'),
    True: ('{"a": "hel', '{\n  "a": "x",\n  "b": "ab', '{"a": "x", "b": "y", "c": 1', '{"a": "x",\n  '),
}
SCHEMA = {"type": "object", "required": ["a", "b", "c"],
          "properties": {"a": {"type": "string"}, "b": {"type": "string", "maxLength": 40}, "c": {"type": "integer"}}}


def one(model: str, config: str) -> dict:
    """Run in the child: build one slice set, time its masks."""
    import ctypes
    import gc
    import statistics
    import time

    import llguidance
    import numpy as np

    from imp.constrain.vocab import build_tokenizer
    from imp.fetch import resolve_model
    from imp.formats.gguf_loader import open_gguf
    from imp.text.tokenizer import Tokenizer

    def anon_mb() -> float:
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024

    g = open_gguf(str(resolve_model(model)))
    tok = Tokenizer.from_gguf_metadata(g.metadata)
    V = tok.vocab_size
    NV = max(V, int(g.config.vocab_size))
    pieces = [tok.piece_bytes(i) for i in range(V)]
    special = [i for i in range(V) if tok.is_special(i)]
    WS, _S10, S30, _SU = llguidance.LLTokenizer.general_slices()
    slices = {"default": list(llguidance.LLTokenizer.general_slices()), "ws,30": [WS, S30], "30": [S30],
              "none": []}[config]
    build_tokenizer(pieces[:1000], [0], [], slices=[])
    a0 = anon_mb()
    lt = build_tokenizer(pieces, tok.eos_ids, special, n_vocab=NV, slices=slices)
    mb = anon_mb() - a0
    words = np.zeros((NV + 31) // 32, dtype=np.int32)
    out = {"mb": mb}
    for flex in (False, True):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                                defaults={"whitespace_flexible": flex})
        for ctx, prefix in zip(CONTEXTS, PREFIXES[flex]):
            ids = tok.encode(prefix)
            ts = []
            for _ in range(30):
                m = llguidance.LLMatcher(lt, grammar)
                for t in ids:
                    assert m.consume_token(t), (prefix, t)
                t0 = time.perf_counter()
                m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
                ts.append(time.perf_counter() - t0)
            out[f"{'flexible' if flex else 'strict'} {ctx}"] = statistics.median(ts) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.model, args.child)))
        return
    cols = [f"{w} {c}" for w in ("strict", "flexible") for c in CONTEXTS]
    print(f"model: {args.model}; first mask of a fresh matcher, median of 30, us\n")
    print("| slices | MB | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for _ in range(args.rounds):
        for config in CONFIGS:
            res = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", config],
                                 capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"| {config} | {r['mb']:.0f} | " + " | ".join(f"{r[c]:.0f}" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
