"""GPU benchmark: one command on the GPU machine, prints a markdown table last.

    python3 bench/gpu.py [--out DIR] [--models 135m,8b-bf16,8b-q4k] [--prefill 512,4096]

1. measures the ceilings once: device-to-device copy rate (bytes read + written)
   and a bf16 8192^3 matmul;
2. writes random-weight GGUFs to /tmp/imp_bench (SmolLM2-135M shape Q4_1 with a
   Q8_0 tied embedding; Llama-3-8B shape BF16; 8B Q4_K with Q6_K attn_v /
   ffn_down / output, like Q4_K_M) with `imp.model.synth_raw` (tiled random
   blocks: disk-bound);
3. correctness: 135M greedy tokens and logits vs the CPU runner (fp32
   weights); each model's graph-replayed decode logits vs its eager logits;
4. decode tok/s at batch 1, 8, 64 after 128-token prompts (wall clock through
   `GpuModelRunner.step`, SeqWork in, SampledToken out: Python included), the
   graph replay's device time, achieved bandwidth (weights + KV read per
   step) as % of the copy rate; prefill tok/s at 512 (and 4096).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf import GGMLQuantizationType as T  # noqa: E402

from imp.messages import SamplingParams, SeqWork  # noqa: E402
from imp.model.gpu_runner import GpuModelRunner  # noqa: E402
from imp.model.synth_raw import write_raw_gguf  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 20)
BS = 16
PROMPT = 128
ANCHORS = {  # llama.cpp CUDA, H200, same shapes (issue 6)
    ("135m-q4_1", 1): "808–882", ("135m-q4_1", 8): "4,535", ("135m-q4_1", 64): "12,394", ("135m-q4_1", "prefill"): "~44k",
    ("8b-bf16", 1): "204–206", ("8b-bf16", 8): "1,086", ("8b-bf16", 64): "7,402", ("8b-bf16", "prefill"): "24.9k–28.9k",
    ("8b-q4_k", 1): "247–252", ("8b-q4_k", 8): "977", ("8b-q4_k", 64): "4,603", ("8b-q4_k", "prefill"): "9.4k–10k",
}
SHAPES = {
    "135m-q4_1": dict(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, vocab=49152, qtype=T.Q4_1,
                      embed_qtype=T.Q8_0, tied=True, context_length=8192, rope_theta=100000.0),
    "8b-bf16": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=128256, qtype=T.BF16,
                    tied=False, context_length=8192, rope_theta=500000.0),
    "8b-q4_k": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=128256, qtype=T.Q4_K,
                    head_qtype=T.Q6_K, tied=False, context_length=8192, rope_theta=500000.0,
                    overrides={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K}),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    copy = 2 * n / statistics.median(ts)
    del a, b
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        m @ m
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        m @ m
    e.record()
    e.synchronize()
    tflops = 10 * 2 * 8192 ** 3 / (s.elapsed_time(e) / 1e3) / 1e12
    del m
    torch.cuda.empty_cache()
    return {"copy_Bps": copy, "bf16_tflops": tflops}


class Seqs:
    """B sequences with their own block ranges; greedy decode through runner.step."""

    def __init__(self, B: int, prompt: int, max_new: int, rng, vocab: int):
        nb = (prompt + max_new) // BS + 1
        self.tables = [list(range(i * nb, (i + 1) * nb)) for i in range(B)]
        self.prompts = [rng.integers(300, vocab, size=prompt).tolist() for _ in range(B)]
        self.out: list[list[int]] = [[] for _ in range(B)]

    def prefill(self, runner) -> None:
        seqs = [SeqWork(seq_id=str(i), token_ids=p, start_pos=0, block_table=self.tables[i], sample=True,
                        params=GREEDY) for i, p in enumerate(self.prompts)]
        for o, t in zip(self.out, runner.step(seqs)):
            o.append(t.token_id)

    def decode(self, runner) -> None:
        seqs = [SeqWork(seq_id=str(i), token_ids=[o[-1]], start_pos=len(p) + len(o) - 1, block_table=self.tables[i],
                        sample=True, params=GREEDY, gen_index=len(o))
                for i, (p, o) in enumerate(zip(self.prompts, self.out))]
        for o, t in zip(self.out, runner.step(seqs)):
            o.append(t.token_id)

    def decode_works(self) -> list[SeqWork]:
        return [SeqWork(seq_id=str(i), token_ids=[o[-1]], start_pos=len(p) + len(o) - 1, block_table=self.tables[i],
                        sample=True, params=GREEDY, gen_index=len(o))
                for i, (p, o) in enumerate(zip(self.prompts, self.out))]


def check_135m_vs_cpu(path: str, res: dict) -> None:
    from imp.model.runner import ModelRunner

    cpu = ModelRunner.load(path, num_blocks=256, block_size=BS, weights="f32")
    gpu = GpuModelRunner.load(path, num_blocks=256, block_size=BS, kv_dtype=torch.float32, dense=False,
                              max_graph_batch=4)
    rng = np.random.default_rng(1)
    outs = []
    for r in (cpu, gpu):
        s = Seqs(3, 64, 40, rng, 49152)  # tables sized for 64 + 40 positions
        s.prompts = [list(range(400, 400 + n)) for n in (7, 60, 1)]
        s.prefill(r)
        for _ in range(8):
            s.decode(r)
        outs.append(s.out)
    seqs = [SeqWork(seq_id="a", token_ids=list(range(500, 540)), start_pos=0, block_table=[100, 101, 102], sample=True,
                    params=GREEDY)]
    ref = cpu.forward(seqs).double()
    got = gpu.forward(seqs).double().cpu()
    res["135m_cpu_greedy_equal"] = outs[0] == outs[1]
    res["135m_logits_rel_err_vs_cpu"] = float((got - ref).norm() / ref.norm())
    log(f"135M vs CPU: greedy equal={outs[0] == outs[1]} logits rel err={res['135m_logits_rel_err_vs_cpu']:.2e}")
    if outs[0] != outs[1]:
        log(f"  cpu {outs[0]}\n  gpu {outs[1]}")


def graph_vs_eager(runner, name: str, res: dict) -> None:
    rng = np.random.default_rng(2)
    s = Seqs(5, 33, 8, rng, runner.config.vocab_size)
    s.prefill(runner)
    works = s.decode_works()
    with torch.inference_mode():
        g = runner._replay(works).double().cpu()
        e = runner.forward(works).double().cpu()
    rel = float((g - e).norm() / e.norm())
    res[f"{name}_graph_vs_eager_rel_err"] = rel
    log(f"{name}: graph vs eager logits rel err {rel:.2e} (buckets {runner.graph_buckets()})")


def bench_model(name: str, path: str, copy_Bps: float, prefills: list[int], rows: list, res: dict) -> None:
    t0 = time.time()
    kv_tokens = 64 * (PROMPT + 96) + max(prefills + [0]) + 1024
    runner = GpuModelRunner.load(path, block_size=BS, kv_tokens=kv_tokens, max_graph_batch=64)
    log(f"{name}: loaded in {time.time() - t0:.1f}s, weights {runner.weight_bytes / 1e9:.2f} GB, dense copies "
        f"{runner.dense}, notes {runner.notes}, tuner {sorted(set(v for v in runner._tuner.values()))}")
    res[f"{name}_tuner"] = {f"{k[0][0]}|n={n}": v for (k, n), v in runner._tuner.items()}
    graph_vs_eager(runner, name, res)
    cfg = runner.config
    kv_per_tok = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * runner.k_cache.element_size()
    for B in (1, 8, 64):
        runner.k_cache.zero_()
        rng = np.random.default_rng(B)
        s = Seqs(B, PROMPT, 96, rng, cfg.vocab_size)
        s.prefill(runner)
        for _ in range(5):
            s.decode(runner)
        steps = 48 if B < 64 else 32
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            s.decode(runner)
        wall = (time.perf_counter() - t) / steps
        dev_ms = runner.timing_probe(s.decode_works())
        ctx = PROMPT + len(s.out[0])
        step_bytes = runner.weight_bytes + B * ctx * kv_per_tok
        bw = step_bytes / (dev_ms / 1e3) / copy_Bps
        row = dict(model=name, batch=B, tok_s=B / wall, step_ms=wall * 1e3, dev_ms=dev_ms, dev_tok_s=B / (dev_ms / 1e3),
                   bw_pct=100 * bw, anchor=ANCHORS.get((name, B), ""))
        rows.append(row)
        log(f"{name} b{B}: {row['tok_s']:.0f} tok/s wall ({wall * 1e3:.3f} ms/step), graph {dev_ms:.3f} ms "
            f"-> {row['dev_tok_s']:.0f} tok/s, {100 * bw:.0f}% of copy rate")
    for P in prefills:
        runner.k_cache.zero_()
        toks = np.random.default_rng(P).integers(300, cfg.vocab_size, size=P).tolist()
        table = list(range((P + BS - 1) // BS + 1))
        work = [SeqWork(seq_id="p", token_ids=toks, start_pos=0, block_table=table, sample=True, params=GREEDY)]
        runner.step(work)
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            runner.step(work)
            ts.append(time.perf_counter() - t)
        tp = P / statistics.median(ts)
        rows.append(dict(model=name, batch=f"prefill {P}", tok_s=tp, step_ms=statistics.median(ts) * 1e3, dev_ms=None,
                         dev_tok_s=None, bw_pct=None, anchor=ANCHORS.get((name, "prefill"), "") if P == 512 else ""))
        log(f"{name} prefill {P}: {tp:.0f} tok/s ({statistics.median(ts) * 1e3:.1f} ms)")
    del runner
    torch.cuda.empty_cache()


def table(rows: list, ceil: dict) -> str:
    out = [f"copy rate {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s", "",
           "| model | batch | tok/s (wall, step()) | ms/step | graph ms | tok/s (graph) | % of copy rate | llama.cpp |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
        out.append(f"| {r['model']} | {r['batch']} | {r['tok_s']:,.0f} | {r['step_ms']:.3f} | {f(r['dev_ms'], '.3f')} | "
                   f"{f(r['dev_tok_s'], ',.0f')} | {f(r['bw_pct'], '.0f')} | {r['anchor']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--models", default="135m-q4_1,8b-bf16,8b-q4_k")
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--dir", default="/tmp/imp_bench")
    ap.add_argument("--skip-cpu-check", action="store_true")
    a = ap.parse_args()
    logging_setup()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    ceil = ceilings()
    res.update(ceil)
    log(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f} TFLOP/s")
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows: list = []
    prefills = [int(x) for x in a.prefill.split(",") if x]
    for name in a.models.split(","):
        path = d / f"{name}.gguf"
        if not path.exists():
            t = time.time()
            write_raw_gguf(path, seed=0, **SHAPES[name])
            log(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.time() - t:.1f}s")
        try:
            if name == "135m-q4_1" and not a.skip_cpu_check:
                check_135m_vs_cpu(str(path), res)
            bench_model(name, str(path), ceil["copy_Bps"], prefills, rows, res)
        except Exception as e:  # noqa: BLE001 - keep going: the other models still get measured
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
        (out / "gpu_bench.json").write_text(json.dumps(dict(res, rows=rows), indent=1, default=str))
        if name != "135m-q4_1":
            path.unlink()  # keep the disk free for the next 8B file
    md = table(rows, ceil)
    (out / "gpu_bench.md").write_text(md + "\n")
    print("\n" + md)


def logging_setup() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    main()
