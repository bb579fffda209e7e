"""Where a CPU prefill's time goes: the fused forward's pieces, timed one by one.

    PYTHONPATH=. .venv/bin/python bench/cpu_forward_parts.py --model gemma-3-270m [--tokens 512]

One real prefill of N tokens through ModelRunner captures the arguments of
`fused_forward.forward_layers`; then every layer's steps (norms, activation quantization,
the GEMMs, q/k norm + RoPE + KV write, attention, the activation, residuals) are called
from Python in the same order on the same shapes, each timed, twice (the second pass is
printed). Calling the pieces one by one adds a little dispatch and thread wake-up per call,
so the sum is a few per cent above the fused call; at small N (decode shapes) that overhead
dominates the per-row pieces and only the GEMM and attention figures mean much.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import imp.kernels.cpu.fused_forward as cf  # noqa: E402
from imp.fetch import resolve_model  # noqa: E402
from imp.messages import SamplingParams, SeqWork  # noqa: E402
from imp.model.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    N = a.tokens
    r = ModelRunner.load(resolve_model(a.model), kv_tokens=max(4096, 2 * N), num_threads=a.threads)
    captured = {}
    fused = cf.forward_layers

    def spy(*args):
        captured["args"] = args
        return fused(*args)

    cf.forward_layers = spy  # fused.py calls it through the module
    try:
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        r.step([SeqWork("p", tuple(range(1, N + 1)), 0, tuple(range((N + 15) // 16)), True, sp)])
    finally:
        cf.forward_layers = fused
    (blob, mats, fv, fo, sliding, x, pos, slots, tables, row_tab, cos_g, sin_g, cos_l, sin_l, kc, vc, nblocks,
     bs, H, Hkv, D, window, neox, act, eps, scale, *_lora) = captured["args"]
    x = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    d = x.shape[1]
    h, y = np.empty((N, d), np.float32), np.empty((N, d), np.float32)
    qkv, attn = np.empty((N, (H + 2 * Hkv) * D), np.float32), np.empty((N, H * D), np.float32)
    dff = mats[0, 4, 1]
    gu, act_out = np.empty((N, 2 * dff), np.float32), np.empty((N, dff), np.float32)
    t: dict[str, float] = {}

    def timed(key, f, *args):
        t0 = time.perf_counter()
        out = f(*args)
        t[key] = t.get(key, 0.0) + time.perf_counter() - t0
        return out

    for _ in range(2):
        t.clear()
        for layer in range(mats.shape[0]):
            timed("norm", cf._norm_rows, x, fv, fo[layer, cf.NORM], eps, h)
            A = timed("quantize", cf._quantize, h)
            timed("gemm qkv", cf._gemm_multi, blob, r.model.kinds, mats, layer, 0, 3, *A, qkv)
            c, s = (cos_l, sin_l) if sliding[layer] else (cos_g, sin_g)
            timed("qk norm, rope, kv write", cf._qkv_post_par, qkv, fv, fo, layer, H, Hkv, D, eps, c, s, pos, neox,
                  kc, vc, nblocks, bs, slots)
            timed("attention", cf.attention, qkv, H, Hkv, D, layer, kc, vc, nblocks, bs, pos, tables, row_tab,
                  window if sliding[layer] else 0, scale, attn)
            A = timed("quantize", cf._quantize, attn)
            timed("gemm o", cf._gemm_multi, blob, r.model.kinds, mats, layer, 3, 4, *A, y)
            timed("residuals", cf._post_norm_add, x, y, fv, fo, layer, cf.POST_ATTN, eps)
            timed("norm", cf._norm_rows, x, fv, fo[layer, cf.FFN_NORM], eps, h)
            A = timed("quantize", cf._quantize, h)
            timed("gemm gate+up", cf._gemm_multi, blob, r.model.kinds, mats, layer, 4, 6, *A, gu)
            timed("activation", cf._act_rows, gu, act_out, dff, act)
            A = timed("quantize", cf._quantize, act_out)
            timed("gemm down", cf._gemm_multi, blob, r.model.kinds, mats, layer, 6, 7, *A, y)
            timed("residuals", cf._post_norm_add, x, y, fv, fo, layer, cf.POST_FFN, eps)
    total = sum(t.values())
    print(f"model: {a.model}, {N} prompt tokens, {mats.shape[0]} layers, threads {a.threads}\n")
    print("| piece | ms | share |\n|---|---|---|")
    for k, v in sorted(t.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v * 1e3:.2f} | {v / total:.0%} |")
    print(f"| all | {total * 1e3:.2f} | {N / total:.0f} tok/s |")


if __name__ == "__main__":
    main()
