"""GPU benchmark: one command on the GPU machine, prints a markdown table last.

    python3 bench/gpu.py [--out DIR] [--models 135m,8b-bf16,8b-q4k] [--prefill 512,4096]

1. measures the ceilings once: device-to-device copy rate (bytes read + written)
   and a bf16 8192^3 matmul;
2. writes random-weight GGUFs to /tmp/imp_bench (SmolLM2-135M shape Q4_1 with a
   Q8_0 tied embedding; Llama-3-8B shape BF16; 8B Q4_K with Q6_K attn_v /
   ffn_down / output, like Q4_K_M) with `tests.fixtures.synth_raw` (tiled random
   blocks: disk-bound);
3. decode tok/s at batch 1, 8, 64 after 128-token prompts (wall clock through
   `GpuModelRunner.step`, SeqWork in, SampledToken out: Python included), the
   graph replay's device time, achieved bandwidth (weights + KV read per
   step) as % of the copy rate; prefill tok/s at 512 (and 4096).

Correctness lives in the GPU test lane (tests/test_gpu_runner.py: greedy and
logits vs the CPU runner on this 135M shape, graph replay vs eager, pipelined
launches vs step by step); run it in the same device call, before this.
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

from imp.config import ServerConfig, gpu_runner_options  # noqa: E402
from imp.messages import PENDING_TOKEN, SamplingParams, SeqWork  # noqa: E402
from imp.gpu.runner import GpuModelRunner  # noqa: E402
from tests.fixtures.synth_raw import write_raw_gguf  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 20)
BS = 16
PROMPT = 128
MAX_NEW = 160  # decode positions per sequence: warm-up + step() timing + pipelined timing
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

    def decode_pipelined(self, runner, steps: int) -> None:
        """`steps` decode steps, each launched before the previous one is collected
        (PENDING_TOKEN fed on the device), as the executor runs a depth-2 scheduler."""
        P, g = len(self.prompts[0]), len(self.out[0])

        def works(j: int) -> list[SeqWork]:
            return [SeqWork(seq_id=str(i), token_ids=[PENDING_TOKEN] if j else [o[-1]], start_pos=P + g - 1 + j,
                            block_table=self.tables[i], sample=True, params=GREEDY, gen_index=g + j, pending=int(j > 0))
                    for i, o in enumerate(self.out)]

        h = runner.launch(works(0))
        for j in range(1, steps + 1):
            nxt = runner.launch(works(j)) if j < steps else None
            for o, t in zip(self.out, runner.collect(h)):
                o.append(t.token_id)
            h = nxt

    def decode_works(self) -> list[SeqWork]:
        return [SeqWork(seq_id=str(i), token_ids=[o[-1]], start_pos=len(p) + len(o) - 1, block_table=self.tables[i],
                        sample=True, params=GREEDY, gen_index=len(o))
                for i, (p, o) in enumerate(zip(self.prompts, self.out))]


def linear_table(runner, name: str, copy_Bps: float, res: dict) -> str:
    """The tuner's graph-replayed timings (rotating over the layers' copies of each matrix) as a table."""
    from imp.kernels.cuda.quant_weight import BITS  # noqa: PLC0415

    head = (f"{name}: per-matrix device time, µs (GB/s of the weight as stored), n = rows of x; * = chosen "
            "(fused variants have 2 µs per saved kernel taken off)")
    times_all = runner.w.tune_stats["times"]
    order = ("gemv", "q8r1", "q8r2", "q8r4", "q8s1", "q8s2", "q8s4", "qmm", "x4", "x8", "a4", "k4", "dense")
    seen = {c for t in times_all.values() for c in t}
    cands = [c for c in order if c in seen] + sorted(seen - set(order))
    out = [head, "", "| matrix | n | " + " | ".join(cands) + " |", "|---|---|" + "---|" * len(cands)]
    for (key, n), times in sorted(times_all.items(), key=lambda kv: (kv[0][1], -kv[0][0][0][0][1])):
        rows_, cols = sum(r for _, r in key[0]), key[1]
        nbytes = sum(r * cols * BITS[f] / 8 for f, r in key[0])
        best = runner.w.tuner.get((key, n))
        cells = []
        for c in cands:
            t = times.get(c)
            cells.append("" if t is None else f"{t:.1f} ({nbytes / t / 1e3:.0f}){'*' if c == best else ''}")
        fmts = "+".join(f for f, _ in key[0])
        out.append(f"| {fmts} {rows_}x{cols} | {n} | " + " | ".join(cells) + " |")
    res[f"{name}_tune_failed"] = runner.w.tune_stats["failed"]
    res[f"{name}_tune_times"] = {f"{k[0]}|n={n}": v for (k, n), v in times_all.items()}
    return "\n".join(out)


def b1_configs(runner, name: str, copy_Bps: float, rows: list, res: dict) -> None:
    """Batch-1 decode under three configurations, graphs re-captured for bucket 1 only:
    legacy (old gemv_bf16 kernel, cuBLAS O projection, separate RoPE / KV write / SiLU*up kernels),
    new kernels unfused, and the tuned default (new kernels, fused epilogues)."""
    cfg = runner.config
    keys = {a: getattr(runner.w.layers[0], a).key for a in ("wqkv", "wo", "w13", "w2")}
    keys["head"] = runner.w.head.key
    saved_tuner, saved_fuse, saved_buckets = dict(runner.w.tuner), runner.fwd.fuse, runner.graphs.buckets
    best_x = {a: saved_tuner.get((k, 1)) for a, k in keys.items()}
    configs = {
        "legacy": ({a: ("dense" if a == "wo" else "gemv") for a in keys}, False),
        "new kernels, unfused": (best_x, False),
        "new kernels, fused (default)": (best_x, True),
    }
    kv_per_tok = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * runner.k_cache.element_size()
    runner.graphs.buckets = (1,)
    try:
        for label, (modes, fuse) in configs.items():
            for a, k in keys.items():
                runner.w.tuner[(k, 1)] = modes[a]
            runner.fwd.fuse = fuse
            runner.graphs.graphs.clear()
            torch.cuda.empty_cache()
            runner.graphs.capture(runner.fwd)
            runner.k_cache.zero_()
            s = Seqs(1, PROMPT, 96, np.random.default_rng(1), cfg.vocab_size)
            s.prefill(runner)
            for _ in range(5):
                s.decode(runner)
            steps = 64
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                s.decode(runner)
            wall = (time.perf_counter() - t) / steps
            dev_ms = runner.timing_probe(s.decode_works(), reps=40)
            ctx = PROMPT + len(s.out[0])
            bw = (runner.w.weight_bytes + ctx * kv_per_tok) / (dev_ms / 1e3) / copy_Bps
            row = dict(model=f"{name} [{label}: {modes}]", batch=1, tok_s=1 / wall, step_ms=wall * 1e3, dev_ms=dev_ms,
                       dev_tok_s=1e3 / dev_ms, bw_pct=100 * bw, anchor=ANCHORS.get((name, 1), ""))
            rows.append(row)
            res.setdefault(f"{name}_b1_configs", []).append(row)
            log(f"{name} b1 [{label}] {modes}: {1 / wall:.1f} tok/s wall ({wall * 1e3:.3f} ms), graph {dev_ms:.3f} ms, "
                f"{100 * bw:.0f}% of copy rate")
    finally:
        runner.w.tuner.clear()
        runner.w.tuner.update(saved_tuner)
        runner.fwd.fuse, runner.graphs.buckets = saved_fuse, saved_buckets
        runner.graphs.graphs.clear()
        torch.cuda.empty_cache()
        runner.graphs.capture(runner.fwd)


def profile_decode(runner, name: str, out: Path, res: dict) -> None:
    """Per-kernel device time of a batch-1 decode step (eager launches of the graph's kernels; the eager
    path adds an index_select / index_copy_ around the attention)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = runner.config
    s = Seqs(1, PROMPT, 16, np.random.default_rng(5), cfg.vocab_size)
    s.prefill(runner)
    works = s.decode_works()
    with torch.inference_mode():
        for _ in range(2):
            runner.forward(works)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.forward(works)
            torch.cuda.synchronize()
    txt = f"{name} b1 decode, eager, 5 steps: per-kernel device time\n" + prof.key_averages().table(
        sort_by="device_time_total", row_limit=16, max_name_column_width=70)
    (out / f"profile_decode_{name}.txt").write_text(txt)
    print(txt, flush=True)


def profile_prefill(runner, name: str, P: int, out: Path, res: dict) -> None:
    """Where one eager prefill of P tokens spends its time: host time per launcher (no syncs), the
    Numba vs CuPy KV write in eager steps, and torch.profiler's kernel table."""
    from imp.kernels.cuda import add_rmsnorm, gated_act, kv_write, prefill_attention_sdpa, rope
    from imp.gpu import linear as gpu_linear

    cfg = runner.config
    toks = np.random.default_rng(P).integers(300, cfg.vocab_size, size=P).tolist()
    table = list(range((P + BS - 1) // BS + 1))
    work = [SeqWork(seq_id="p", token_ids=toks, start_pos=0, block_table=table, sample=True, params=GREEDY)]

    def timed(n=3):
        runner.step(work)
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            runner.step(work)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    ms = timed()
    res[f"{name}_prefill{P}_ms"] = ms
    log(f"{name} prefill {P}: {ms:.1f} ms")
    host: dict[str, list] = {}
    patched = []

    def wrap(obj, attr, label):
        fn = getattr(obj, attr)

        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                host.setdefault(label, []).append(time.perf_counter() - t)

        setattr(obj, attr, w)
        patched.append((obj, attr, fn))

    for obj, attr in ((kv_write, "kv_write"), (kv_write, "kv_write_cupy"), (prefill_attention_sdpa, "prefill_attention"),
                      (add_rmsnorm, "add_rmsnorm"), (rope, "rope"), (gated_act, "gated_act"), (gpu_linear.Linear, "run"),
                      (runner, "_eager_meta"), (runner, "_sample")):
        wrap(obj, attr, f"{getattr(obj, '__name__', type(obj).__name__)}.{attr}")
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.step(work)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    finally:
        for obj, attr, fn in reversed(patched):
            if obj is runner:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
    lines = [f"{name} prefill {P}: wall {wall:.1f} ms (eager KV write cupy); host time inside launchers (no sync):"]
    for k, v in sorted(host.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {k:40s} calls {len(v):4d}  total {sum(v) * 1e3:7.2f} ms  mean {statistics.mean(v) * 1e6:7.1f} us")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step(work)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    lines.append(ka.table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
    lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    txt = "\n".join(lines)
    (out / f"profile_prefill_{name}.txt").write_text(txt)
    print(txt, flush=True)


def long_decode(runner, name: str, L: int, batches: list, copy_Bps: float, rows: list, steps: int = 16,
                chunk_rows: int = 1024) -> None:
    """Decode at an agent's context (issue 39): one L-token prompt prefilled in `chunk_rows`-token chunks (the
    server's default chunk on a GPU: imp.config's max_step_tokens auto, 1,024; its rate is a row: what a user's
    16k-token prompt costs through the server's chunks, against llama-bench -p L), then for each B of `batches`, B
    rows that share its blocks (a shared system prompt: what agents send) decode from its first sampled token, each
    into its own blocks (the shared prefix is only read, so every B reuses it). The bytes a step must read: the
    weights + B x L positions of K/V."""
    cfg = runner.config
    L -= L % BS
    runner.k_cache.zero_()
    toks = np.random.default_rng(L).integers(300, cfg.vocab_size, size=L).tolist()
    shared = list(range(L // BS))
    first = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c0 in range(0, L, chunk_rows):
        chunk = toks[c0:c0 + chunk_rows]
        last = c0 + len(chunk) >= L
        w = SeqWork(seq_id="p", token_ids=chunk, start_pos=c0, block_table=shared, sample=last, params=GREEDY)
        got = runner.step([w])
        if last:
            first = got[0].token_id
    pf = time.perf_counter() - t0  # step() returns sampled tokens: the last chunk's work is done
    rows.append(dict(model=name, batch=f"prefill {L:,} ({chunk_rows:,}-row chunks)", tok_s=L / pf,
                     step_ms=pf * 1e3, dev_ms=None, dev_tok_s=None, bw_pct=None, anchor="", pipe_tok_s=None))
    log(f"{name} prefill {L} in {chunk_rows}-row chunks: {L / pf:.0f} tok/s ({pf * 1e3:.0f} ms)")
    for B in batches:
        try:
            _long_rows(runner, name, L, B, shared, first, copy_Bps, rows, steps)
        except Exception as e:  # noqa: BLE001 - a cell past the card's memory: say so, keep going
            log(f"{name} b{B} at {L}: {type(e).__name__}: {e}")


def _long_rows(runner, name: str, L: int, B: int, shared: list, first: int, copy_Bps: float, rows: list,
               steps: int) -> None:
    cfg = runner.config
    own = (steps * 2 + 16) // BS + 2
    tables = [shared + list(range(len(shared) + i * own, len(shared) + (i + 1) * own)) for i in range(B)]
    out = [[first] for _ in range(B)]

    def works(pending: int = 0, j: int = 0) -> list[SeqWork]:
        g = len(out[0])
        return [SeqWork(seq_id=str(i), token_ids=[PENDING_TOKEN] if pending else [o[-1]], start_pos=L + g - 1 + j,
                        block_table=tables[i], sample=True, params=GREEDY, gen_index=g + j, pending=pending)
                for i, o in enumerate(out)]

    def step() -> None:
        for o, t in zip(out, runner.step(works())):
            o.append(t.token_id)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t) / steps
    dev_ms = runner.timing_probe(works())
    kv_per_tok = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * runner.k_cache.element_size()
    step_bytes = runner.w.weight_bytes + B * L * kv_per_tok
    bw = step_bytes / (dev_ms / 1e3) / copy_Bps
    rows.append(dict(model=name, batch=f"{B} @ {L:,}", tok_s=B / wall, step_ms=wall * 1e3, dev_ms=dev_ms,
                     dev_tok_s=B / (dev_ms / 1e3), bw_pct=100 * bw, anchor="", pipe_tok_s=None))
    log(f"{name} b{B} at {L} positions: {B / wall:.0f} tok/s wall ({wall * 1e3:.3f} ms/step), graph {dev_ms:.3f} ms, "
        f"{100 * bw:.0f}% of copy rate (weights + K/V)")


def bench_model(name: str, path: str, copy_Bps: float, prefills: list[int], rows: list, res: dict,
                extras: bool = False, out: Path | None = None, label: str = "", long: tuple = (), **runner_kw) -> None:
    t0 = time.time()
    kv_tokens = 64 * (PROMPT + MAX_NEW) + max(prefills + [0]) + 1024
    if long:  # (contexts, batches): one shared prompt of the longest + each row's own blocks
        kv_tokens = max(kv_tokens, max(long[0]) + max(long[1]) * (64 + 2 * BS) + 1024)
    torch.cuda.reset_peak_memory_stats()
    runner = GpuModelRunner.load(path, block_size=BS, kv_tokens=kv_tokens, max_graph_batch=64, **runner_kw)
    base, name = name, name + label
    kv_bytes = runner.k_cache.numel() * runner.k_cache.element_size() * 2
    mem = torch.cuda.memory_allocated() - kv_bytes
    res[f"{name}_device_bytes_without_kv"] = mem
    log(f"{name}: loaded in {time.time() - t0:.1f}s, weights {runner.w.weight_bytes / 1e9:.2f} GB, dense copies "
        f"{runner.w.dense}, device memory without the KV pool {mem / 1e9:.2f} GB, notes {runner.notes}, "
        f"tuner {sorted(set(v for v in runner.w.tuner.values()))}")
    res[f"{name}_tuner"] = {f"{k[0]}x{k[1]}|n={n}": v for (k, n), v in runner.w.tuner.items()}
    cfg = runner.config
    kv_per_tok = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * runner.k_cache.element_size()
    for B in (1, 8, 64):
        runner.k_cache.zero_()
        rng = np.random.default_rng(B)
        s = Seqs(B, PROMPT, MAX_NEW, rng, cfg.vocab_size)
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
        s.decode_pipelined(runner, 4)  # warm
        torch.cuda.synchronize()
        t = time.perf_counter()
        s.decode_pipelined(runner, steps)
        pipe = (time.perf_counter() - t) / steps
        ctx = PROMPT + len(s.out[0])
        step_bytes = runner.w.weight_bytes + B * ctx * kv_per_tok
        bw = step_bytes / (dev_ms / 1e3) / copy_Bps
        row = dict(model=name, batch=B, tok_s=B / wall, step_ms=wall * 1e3, dev_ms=dev_ms, dev_tok_s=B / (dev_ms / 1e3),
                   bw_pct=100 * bw, anchor=ANCHORS.get((base, B), ""), pipe_tok_s=B / pipe)
        rows.append(row)
        log(f"{name} b{B}: {row['tok_s']:.0f} tok/s wall ({wall * 1e3:.3f} ms/step), pipelined {B / pipe:.0f} tok/s "
            f"({pipe * 1e3:.3f} ms/step), graph {dev_ms:.3f} ms "
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
                         pipe_tok_s=None,
                         dev_tok_s=None, bw_pct=None, anchor=ANCHORS.get((base, "prefill"), "") if P == 512 else ""))
        log(f"{name} prefill {P}: {tp:.0f} tok/s ({statistics.median(ts) * 1e3:.1f} ms)")
    for L in (long[0] if long else ()):
        try:
            long_decode(runner, name, L, long[1], copy_Bps, rows)
        except Exception as e:  # noqa: BLE001 - a cell past the card's memory: say so, keep going
            log(f"{name} at {L}: {type(e).__name__}: {e}")
    lt = linear_table(runner, name, copy_Bps, res)  # the tuner's own timings: no extra device work
    print(lt, flush=True)
    (out or Path("/tmp")).joinpath(f"linears_{name.replace(' ', '_')}.md").write_text(lt + "\n")
    if extras:
        for fn, a in ((b1_configs, (runner, name, copy_Bps, rows, res)),
                      (profile_decode, (runner, name, out or Path("/tmp"), res)),
                      (profile_prefill, (runner, name, 512, out or Path("/tmp"), res))):
            try:
                r = fn(*a)
                if isinstance(r, str):
                    print(r, flush=True)
                    (out or Path("/tmp")).joinpath(f"linears_{name}.md").write_text(r + "\n")
            except Exception:  # noqa: BLE001
                import traceback

                traceback.print_exc()
    del runner
    torch.cuda.empty_cache()


# "default": what `python -m imp --device cuda:0` loads (imp.config.gpu_runner_options on the defaults). Until
# 2026-12-06 it was fp32 activations while the server ran int8 ones (issue 39): those rows were not what users run.
CONFIGS = {"default": gpu_runner_options(ServerConfig(device="cuda:0")), "fp32": {"int8_act": False}, "int8": {"int8_act": True},
           "int8-nodense": {"int8_act": True, "dense": False}, "invariant": {"int8_act": True, "batch_invariant": True},
           "split": dict(gpu_runner_options(ServerConfig(device="cuda:0")), decode_attention="split"),
           "paged": dict(gpu_runner_options(ServerConfig(device="cuda:0")), decode_attention="paged"),
           "mma": dict(gpu_runner_options(ServerConfig(device="cuda:0")), decode_attention="mma"),
           "q8_0": dict(gpu_runner_options(ServerConfig(device="cuda:0")), requant="q8_0")}


def table(rows: list, ceil: dict) -> str:
    out = [f"copy rate {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s", "",
           "| model | batch | tok/s (wall, step()) | tok/s (pipelined launch/collect) | ms/step | graph ms | "
           "tok/s (graph) | % of copy rate | llama.cpp |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
        out.append(f"| {r['model']} | {r['batch']} | {r['tok_s']:,.0f} | {f(r.get('pipe_tok_s'), ',.0f')} | "
                   f"{r['step_ms']:.3f} | {f(r['dev_ms'], '.3f')} | "
                   f"{f(r['dev_tok_s'], ',.0f')} | {f(r['bw_pct'], '.0f')} | {r['anchor']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--models", default="135m-q4_1,8b-bf16,8b-q4_k")
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--dir", default="/tmp/imp_bench")
    ap.add_argument("--configs", default="default",
                    help="runner configurations per model, comma list of default (what `python -m imp --device "
                         "cuda:0` runs: its defaults, int8 activations today) | fp32 (--gpu-activations fp32) | int8 | "
                         "int8-nodense (and no fp16 dense copies) | invariant (--batch-invariant: every matmul on the "
                         "int8 GEMM) | split / paged (the default with --gpu-decode-attention split / paged) | q8_0 (the default "
                         "with --weights q8_0: a BF16 model's matrices as Q8_0)")
    ap.add_argument("--long-ctx", default="", help="decode at these contexts too (issue 39: e.g. 4096,16384,32768): "
                    "one shared prompt, --long-batch rows decoding after it; the models are written with a context "
                    "that holds the longest")
    ap.add_argument("--long-batch", default="1,16")
    ap.add_argument("--keep", action="store_true", help="keep the 8B files (llama.cpp reads the same ones after)")
    ap.add_argument("--extras", default="", help="models (comma list) that also get the per-matrix table, "
                    "the batch-1 legacy/unfused/fused comparison and the decode / prefill-512 profiles. "
                    "torch.profiler leaves CUPTI attached: models measured after it in the same process "
                    "launch slower (seen: 135M b1 1,043 -> 869 tok/s), so give it the last model or run it alone")
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
    long = ([int(x) for x in a.long_ctx.split(",") if x], [int(x) for x in a.long_batch.split(",") if x])
    long = long if long[0] else ()
    for name in a.models.split(","):
        shape = dict(SHAPES[name])
        if long:
            shape["context_length"] = max(shape.get("context_length", 0), max(long[0]) + 512)
        path = d / (f"{name}.gguf" if not long else f"{name}-{shape['context_length']}.gguf")
        if not path.exists():
            t = time.time()
            write_raw_gguf(path, seed=0, **shape)
            log(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.time() - t:.1f}s")
        for conf in a.configs.split(","):
            kw = CONFIGS[conf]
            try:
                bench_model(name, str(path), ceil["copy_Bps"], prefills, rows, res,
                            extras=name in a.extras.split(","), out=out,
                            label="" if conf == "default" else f" {conf}", long=long, **kw)
            except Exception as e:  # noqa: BLE001 - keep going: the other models still get measured
                import traceback

                traceback.print_exc()
                res[f"{name} {conf}_error"] = f"{type(e).__name__}: {e}"
        (out / "gpu_bench.json").write_text(json.dumps(dict(res, rows=rows), indent=1, default=str))
        if name != "135m-q4_1" and not a.keep:
            path.unlink()  # keep the disk free for the next 8B file
    md = table(rows, ceil) + f"\n\nrows without a suffix: the server's defaults ({CONFIGS['default']}); a suffix names the other configuration"
    (out / "gpu_bench.md").write_text(md + "\n")
    print("\n" + md)


def logging_setup() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    main()
