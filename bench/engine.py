"""The engine without HTTP on the serving workload: what the engine delivers against its runner's bound.

    .venv/bin/python bench/engine.py --model smollm2-135m [--device cuda:0] [--streams 1,16,64]
        [--prompt 234] [--answer 128] [--rounds 2] [--server-args "--max-batch-size 256 ..."]
    .venv/bin/python bench/engine.py --model tiny ...      # a 2-layer random model: the host's cost alone
    .venv/bin/python bench/engine.py --null-step-us 1650 ... # no model math, a make-believe device's steps

Everything the server runs below HTTP runs here, as `python -m imp` builds it (`imp.server.load_engine`:
admission, scheduler, KV allocator, executor, detok, ingress; the event log to a file) on one uvloop; each
stream reads its request's token ids as the engine port hands them over (rendering them as text is the HTTP
side's work, in an API-server process on a GPU host: `--http` measures it). At each concurrency C, C requests are in flight at all times (a finished one is replaced at once)
until C x --rounds have finished; each prompt is --prompt random token ids (distinct: no prefix-cache hit),
each answer --answer greedy tokens with ignore_eos. Reported per C:

- tok/s: answer tokens / wall (first submit to last finish), TTFT and ITL p50 / p99 as the consumer of
  each stream sees them (ITL: between consecutive deltas, so a merged delta counts once); CPU µs a token:
  the process's CPU time over the level (every thread: the engine's and the streams' readers) / answer
  tokens, the host's cost a token that a noisy shared box's wall hides (with --null-step-us it is all host);
- the steps by kind, read from the event log: decode-only, mixed (decode rows and prompt rows) and
  prefill-only: how many, their mean prompt and decode rows, the executor's time a step
  (StepResult.elapsed_ns: plan received -> tokens collected; pipelined on a GPU that also holds the
  step before it) and the device's own (StepResult.device_ns, CUDA events; "not timed" on a CPU)
  p50 / p99, and the share of the wall each kind's device time (else executor time) fills ("idle":
  the wall no step covered: the device waited for the host);
- the bound from the runner's own rates, measured on the same runner before the engine starts (a
  512-token prefill; C rows decoding at context --prompt, pipelined where the runner launches):
  a token costs its share of prompt at the prefill rate plus one decode row at batch C's rate,
  bound = 1 / (P / (A x prefill tok/s) + 1 / decode tok/s(C)), and the engine's share of it.

With --null-step-us T (IMP_NULL_RUNNER, imp/model/null_runner.py) no model runs: each step lands T µs
(+ --null-row-us a one-token row, + --null-token-us a prompt token: a GPU's cost shape) after the one before,
pipelined as on a GPU, so a machine without one asks whether the host keeps a
device of that step time busy (the bound is then C tokens every T µs, and prefill costs one step).

The serving benchmarks (bench/serving.py on the GPU, bench/cpu_serving.py) send the same workload over
HTTP; the difference between the two is the HTTP side's cost. --json FILE writes the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

# a 2-layer random llama (tests/fixtures/synth_raw): the engine's host work with a near-free forward
TINY = dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, vocab=4096, context_length=8192, qtype=T.Q8_0)
LOW_ID = 300  # prompt ids from here up: past the specials of the real vocabularies


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def runner_rates(runner, streams: list[int], P: int, vocab: int, steps: int = 12) -> tuple[float, dict[int, float]]:
    """The runner's own prefill tok/s (one 512-token prompt) and decode tok/s at each batch in
    `streams` (rows at context P; launch/collect pipelined on a runner that launches)."""
    from imp.messages import PENDING_TOKEN, SamplingParams, SeqWork

    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    bs, rng = runner.block_size, np.random.default_rng(0)
    if str(getattr(runner, "device", "cpu")).startswith("cuda"):  # time what the device did
        import torch

        sync = torch.cuda.synchronize
    else:
        def sync() -> None:
            pass

    def timed(fn, reps: int = 3) -> float:
        fn()
        ts = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    Pp = 512
    table = tuple(range((Pp + bs - 1) // bs))
    toks = tuple(int(t) for t in rng.integers(LOW_ID, vocab, size=Pp))
    one = [SeqWork("p", toks, 0, table, True, greedy)]
    if hasattr(runner, "launch"):  # as the executor runs it (a paced null runner's step is free)
        prefill = Pp / timed(lambda: runner.collect(runner.launch(one)))
    else:
        prefill = Pp / timed(lambda: runner.step(one))
    decode = {}
    per = (P + steps + 8) // bs + 1
    for C in streams:
        if C * per > runner.num_blocks:
            decode[C] = float("nan")  # the pool cannot hold C rows at this context
            continue
        tables = [tuple(range(i * per, (i + 1) * per)) for i in range(C)]
        prompts = [tuple(int(t) for t in rng.integers(LOW_ID, vocab, size=P)) for _ in range(C)]
        last = [0] * C
        chunk = max(1, 512 // P)  # prompts a prefill step
        for a in range(0, C, chunk):
            outs = runner.step([SeqWork(str(i), prompts[i], 0, tables[i], True, greedy) for i in range(a, min(C, a + chunk))])
            for i, t in zip(range(a, min(C, a + chunk)), outs):
                last[i] = t.token_id
        g = [1]  # tokens generated so far (each row alike)

        def works(j: int, pending: bool):
            return [SeqWork(str(i), (PENDING_TOKEN,) if pending else (last[i],), P + g[0] - 1 + j, tables[i], True,
                            greedy, gen_index=g[0] + j, pending=int(pending)) for i in range(C)]

        def run(n: int) -> None:
            if hasattr(runner, "launch"):  # depth 2, as the executor runs it
                h = runner.launch(works(0, False))
                for j in range(1, n + 1):
                    nxt = runner.launch(works(j, True)) if j < n else None
                    outs = runner.collect(h)
                    h = nxt
            else:
                for _ in range(n):
                    outs = runner.step(works(0, False))
                    for i, t in enumerate(outs):
                        last[i] = t.token_id
                    g[0] += 1
                return
            for i, t in enumerate(outs):
                last[i] = t.token_id
            g[0] += n

        run(2)
        sync()
        t = time.perf_counter()
        run(steps)
        sync()
        decode[C] = C * steps / (time.perf_counter() - t)
    return prefill, decode


def print_steps(rows: list[dict], log_path: str) -> None:
    """The steps table of `rows` (each with streams, t0_ns, t1_ns, wall_s) from the event log at log_path; each
    row gets its "steps"."""
    print("\n| streams | step kind | steps | prompt / decode rows (mean) | executor ms p50 / p99 | device ms p50 / p99 "
          "| device share of wall |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        by = step_kinds(log_path, row["t0_ns"], row["t1_ns"])
        covered = 0.0
        kinds = {}
        for kind in ("decode-only", "mixed", "prefill-only"):
            st = by.get(kind, [])
            if not st:
                kinds[kind] = dict(steps=0)
                continue
            es, ds = [x[0] for x in st], [x[1] for x in st]
            cost = [d or e for e, d in zip(es, ds)]  # the device's time where measured (pipelined: the wall
            share = sum(cost) / 1e9 / row["wall_s"]  # from plan to tokens also holds the step before)
            covered += share
            pr, dr = sum(x[2] for x in st) / len(st), sum(x[3] for x in st) / len(st)
            kinds[kind] = dict(steps=len(st), prompt_rows=pr, decode_rows=dr, p50_ms=pct(es, 0.5) / 1e6,
                               p99_ms=pct(es, 0.99) / 1e6, device_p50_ms=pct(ds, 0.5) / 1e6,
                               device_p99_ms=pct(ds, 0.99) / 1e6, share=share)
            dev = f"{pct(ds, 0.5) / 1e6:.2f} / {pct(ds, 0.99) / 1e6:.2f}" if any(ds) else "not timed"
            print(f"| {row['streams']} | {kind} | {len(st)} | {pr:.0f} / {dr:.0f} | {pct(es, 0.5) / 1e6:.2f} / "
                  f"{pct(es, 0.99) / 1e6:.2f} | {dev} | {100 * share:.0f} % |")
        if covered <= 1.0:
            print(f"| {row['streams']} | idle (no step running) | | | | | {100 * (1 - covered):.0f} % |")
        row["steps"] = kinds


def step_kinds(log_path: str, t0_ns: int, t1_ns: int) -> dict:
    """The steps whose result landed in [t0, t1], by kind, from the event log: per step (executor ns, device
    ns (0 where the runner does not time it), prompt rows, decode rows)."""
    from imp.log.eventlog import read_log

    _, recs = read_log(log_path)
    shape: dict[int, tuple[str, int, int]] = {}
    landed: dict[int, tuple[int, int]] = {}
    for env in recs:
        p = env.payload
        name = type(p).__name__
        if name == "StepPlan":
            dec = sum(1 for w in p.shares() if len(w.token_ids) == 1 and w.sample)
            prompt = sum(len(w.token_ids) for w in p.shares()) - dec
            shape[p.step] = ("decode-only" if not prompt else ("prefill-only" if not dec else "mixed"), prompt, dec)
        elif name == "StepResult" and t0_ns <= env.wall_ns <= t1_ns:
            landed[p.step] = (p.elapsed_ns, getattr(p, "device_ns", 0))
    by: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    for s, (e, d) in landed.items():
        if s in shape:
            kind, prompt, dec = shape[s]
            by[kind].append((e, d, prompt, dec))
    return by


async def run_level(engine, C: int, rounds: int, P: int, A: int, vocab: int, rep: float = 1.05) -> dict:
    from imp.engine.port import Submission
    from imp.messages import Delta, FinishReason, SamplingParams

    rng = np.random.default_rng(C)
    total, issued = C * rounds, [0]
    ttft: list[float] = []
    itl: list[float] = []
    tokens = [0]
    failed = [0]

    async def worker() -> None:
        while issued[0] < total:
            i = issued[0]
            issued[0] += 1
            prompt = tuple(int(t) for t in rng.integers(LOW_ID, vocab, size=P))
            sub = Submission(f"eng-{C}-{i}", prompt, SamplingParams(max_tokens=A, temperature=0.0, ignore_eos=True,
                                                                    repetition_penalty=rep))
            t0 = time.perf_counter()
            prev = None
            # the raw handle: token ids as the engine hands them over; rendering text (detok, stop strings)
            # is the HTTP side's, in an API-server process on a GPU host: --http measures it
            handle = engine.open(sub)
            try:
                while True:
                    item = await handle.queue.get()
                    now = time.perf_counter()
                    if type(item) is tuple:  # a decode lane row: (choice index, token id), one token
                        tokens[0] += 1
                        if prev is not None:
                            itl.append(now - prev)
                        prev = now
                        continue
                    if type(item) is not Delta:
                        failed[0] += 1
                        break
                    if item.token_ids:
                        tokens[0] += len(item.token_ids)
                        if prev is None:
                            ttft.append(now - t0)
                        else:
                            itl.append(now - prev)
                        prev = now
                    if item.finish != FinishReason.NONE:
                        break
            finally:
                engine.close(handle)

    t0_ns, t0, c0 = time.time_ns(), time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(C)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(streams=C, requests=total, failed=failed[0], tokens=tokens[0], wall_s=wall, tok_s=tokens[0] / wall,
                cpu_us_token=1e6 * cpu / max(1, tokens[0]),
                ttft_p50_ms=1e3 * pct(ttft, 0.5), ttft_p99_ms=1e3 * pct(ttft, 0.99),
                itl_p50_ms=1e3 * pct(itl, 0.5), itl_p99_ms=1e3 * pct(itl, 0.99), t0_ns=t0_ns, t1_ns=time.time_ns())


def _http_share(job: tuple) -> dict:
    """One client process's share of an HTTP level: `streams` streams refilled until `total` requests
    have finished, each a streamed /v1/completions with a token-id prompt (the engine level's workload)."""
    url, streams, total, P, A, vocab, seed, start_at, rep, peer = job

    async def go() -> dict:
        import aiohttp

        rng = np.random.default_rng(seed)
        out = dict(ttft=[], itl=[], tokens=0, failed=0)
        await asyncio.sleep(max(0.0, start_at - time.time()))  # every client process starts at once
        out["start"] = time.time()
        issued = [0]

        async def one(s) -> None:
            prompt = rng.integers(LOW_ID, vocab, size=P).tolist()
            body = {"model": "bench", "prompt": prompt, "max_tokens": A, "temperature": 0, "ignore_eos": True,
                    ("repeat_penalty" if peer else "repetition_penalty"): rep,  # llama-server's name for it
                    "stream": True, "stream_options": {"include_usage": True}}
            chunks, usage = 0, False
            t0, prev = time.perf_counter(), None
            async with s.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    out["failed"] += 1
                    await r.read()
                    return
                async for raw in r.content:
                    if not raw.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(raw[6:])
                    if chunk.get("usage"):
                        out["tokens"] += chunk["usage"]["completion_tokens"]
                        usage = True
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        chunks += 1
                        if prev is None:
                            out["ttft"].append(now - t0)
                        else:
                            out["itl"].append(now - prev)
                        prev = now
            if not usage:  # a server that sends no usage in the stream: its text chunks (a token each)
                out["tokens"] += chunks

        async def worker(s) -> None:
            while issued[0] < total:
                issued[0] += 1
                await one(s)

        # llama-server closes a kept-alive connection between requests (a POST on it then gets ServerDisconnected,
        # aiohttp does not resend): a connection a request for the peer
        conn = aiohttp.TCPConnector(limit=0, force_close=peer)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=conn) as s:
            await asyncio.gather(*(worker(s) for _ in range(streams)))
        out["end"] = time.time()
        return out

    return asyncio.run(go())


def run_http_level(pool, url: str, C: int, rounds: int, P: int, A: int, vocab: int, procs: int,
                   rep: float = 1.05, peer: bool = False) -> dict:
    """The engine level's workload through HTTP, the streams spread over `procs` client processes
    (a pool started once); the wall is from the common start to the last process's last token."""
    procs = max(1, min(procs, C))
    start_at = time.time() + 0.5
    jobs = [(url, C // procs + (i < C % procs), (C // procs + (i < C % procs)) * rounds, P, A, vocab, 1000 * C + i,
             start_at, rep, peer) for i in range(procs)]
    parts = pool.map(_http_share, jobs)
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    ttft = [x for p in parts for x in p["ttft"]]
    itl = [x for p in parts for x in p["itl"]]
    tokens = sum(p["tokens"] for p in parts)
    t0_ns, t1_ns = int(min(p["start"] for p in parts) * 1e9), int(max(p["end"] for p in parts) * 1e9)
    return dict(streams=C, requests=C * rounds, failed=sum(p["failed"] for p in parts), tokens=tokens, wall_s=wall,
                t0_ns=t0_ns, t1_ns=t1_ns,
                tok_s=tokens / wall, ttft_p50_ms=1e3 * pct(ttft, 0.5), ttft_p99_ms=1e3 * pct(ttft, 0.99),
                itl_p50_ms=1e3 * pct(itl, 0.5), itl_p99_ms=1e3 * pct(itl, 0.99))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="a name, a GGUF path, or 'tiny'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--prompt", type=int, default=234)
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--repetition-penalty", type=float, default=1.05,
                    help="every request's, in both the engine's levels and --http's (default: the server's default for "
                         "HTTP requests, so both sides run the same sampler; 1.0: plain greedy, as before 2026-12-06)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--server-args", default="", help="more `python -m imp` flags (--max-batch-size ...)")
    ap.add_argument("--null-step-us", type=int, default=None,
                    help="IMP_NULL_RUNNER: a runner that computes nothing, each step T us of a make-believe "
                         "device, pipelined as a GPU (0: every step at once): the host's own cost")
    ap.add_argument("--null-row-us", type=float, default=0.0, help="--null-step-us's device: + this a one-token row")
    ap.add_argument("--null-token-us", type=float, default=0.0,
                    help="--null-step-us's device: + this a token of a prompt chunk (its prefill rate)")
    ap.add_argument("--null-mixed-us", type=float, default=0.0,
                    help="--null-step-us's device: + this a step with both prompt and decode rows (a GPU's mixed graph)")
    ap.add_argument("--null-buckets", action="store_true",
                    help="--null-step-us's device: a step's prompt rows cost the mixed-graph bucket that holds them "
                         "(a GPU's graphs), and the runner tells the scheduler the buckets' costs as the GPU runner does")
    ap.add_argument("--null-ctx-us", type=float, default=0.0,
                    help="--null-step-us's device: + this a one-token row per 1,000 positions it attends to")
    ap.add_argument("--null-prompt-ctx-us", type=float, default=0.0,
                    help="--null-step-us's device: + this a prompt row per 1,000 positions it attends to")
    ap.add_argument("--null-prompt-ctx-by", default="", help="--null-prompt-ctx-us by the step's prompt bucket, "
                    "e.g. 128:119,256:64.5,512:41.3 (the 8B's H100 log, bench/itl_steps.py)")
    ap.add_argument("--null-boot-ctx-by", choices=("on", "off"), default="on", help="whether the make-believe "
                    "boot reports --null-prompt-ctx-by to the ITL policy (off: the 512 bucket's figure alone)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the event loop's thread at this concurrency "
                    "(one more level after the table's; top 30 by own time)")
    ap.add_argument("--http", action="store_true", help="then the same workload through the real server's HTTP "
                    "(/v1/completions, token-id prompts, streamed), started with the same flags")
    ap.add_argument("--client-procs", type=int, default=4, help="--http: client processes")
    ap.add_argument("--llama-server", default=None, help="--http: then llama.cpp's llama-server (this binary) on the "
                    "same file and workload, -np = streams")
    ap.add_argument("--llama-threads", type=int, default=8, help="llama-server -t")
    ap.add_argument("--llama-streams", default=None, help="llama-server's levels (default: --streams)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default=None, help="keep the event logs here (bench/step_timeline.py reads them)")
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="imp-engine-bench-"))
    logs = Path(a.log_dir) if a.log_dir else tmp
    logs.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model == "tiny":
        from tests.fixtures.synth_raw import write_raw_gguf

        model = write_raw_gguf(tmp / "tiny.gguf", seed=0, **TINY)
    from imp.config import add_serve_args, config_from_args  # the server's own flags, validated as at boot

    argv = ["--model", str(model), "--device", a.device, "--event-log", str(logs / "events.log"),
            "--max-batch-size", str(max(64, max(streams))), *a.server_args.split()]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    parser = argparse.ArgumentParser(prog="python -m imp")
    add_serve_args(parser)
    cfg = config_from_args(parser.parse_args(argv))
    if a.null_step_us is not None:
        os.environ["IMP_NULL_RUNNER"] = "1"
        os.environ["IMP_NULL_STEP_US"] = str(a.null_step_us)
        os.environ["IMP_NULL_ROW_US"], os.environ["IMP_NULL_TOKEN_US"] = str(a.null_row_us), str(a.null_token_us)
        os.environ["IMP_NULL_MIXED_US"] = str(a.null_mixed_us)
        if a.null_buckets:
            os.environ["IMP_NULL_BUCKETS"] = "1"
        os.environ["IMP_NULL_CTX_US"], os.environ["IMP_NULL_PROMPT_CTX_US"] = str(a.null_ctx_us), str(a.null_prompt_ctx_us)
        os.environ["IMP_NULL_PROMPT_CTX_BY"] = a.null_prompt_ctx_by
        os.environ["IMP_NULL_REPORT_CTX_BY"] = "1" if a.null_boot_ctx_by == "on" else "0"
    from imp.server import load_engine

    engine, _text = load_engine(cfg)
    runner = engine.runners[0]
    vocab = runner.config.vocab_size
    prefill, decode = runner_rates(runner, streams, a.prompt, vocab)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop

    async def run_all() -> list[dict]:
        await engine.start()
        try:
            await run_level(engine, 1, 1, 16, 4, vocab)  # warm: every step kind once
            rows = [await run_level(engine, C, a.rounds, a.prompt, a.answer, vocab, a.repetition_penalty)
                    for C in streams]
            if a.profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                row = await run_level(engine, a.profile, a.rounds, a.prompt, a.answer, vocab, a.repetition_penalty)
                prof.disable()
                print(f"\nprofile at {a.profile} streams: {row['tok_s']:,.0f} tok/s, the event loop's thread, by own time")
                pstats.Stats(prof).sort_stats(os.environ.get("IMP_PROFILE_SORT", "tottime")).print_stats(int(os.environ.get("IMP_PROFILE_TOP", "30")))
            return rows
        finally:
            await engine.stop()

    with asyncio.Runner(loop_factory=loop_factory) as r:
        rows = r.run(run_all())
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  model {a.model}  device {a.device}  prompt {a.prompt}  answer {a.answer}"
          f"  rounds {a.rounds}  repetition_penalty {a.repetition_penalty:g}  runner: prefill-512 {prefill:,.0f} tok/s")
    print("| streams | tok/s | bound tok/s | engine / bound | TTFT p50 / p99 ms | ITL p50 / p99 ms | runner decode tok/s "
          "| failed | CPU µs a token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        C = row["streams"]
        bound = 1.0 / (a.prompt / (a.answer * prefill) + 1.0 / decode[C]) if decode[C] == decode[C] else float("nan")
        row.update(bound_tok_s=bound, runner_prefill_tok_s=prefill, runner_decode_tok_s=decode[C])
        print(f"| {C} | {row['tok_s']:,.0f} | {bound:,.0f} | {row['tok_s'] / bound:.2f} | {row['ttft_p50_ms']:.0f} / "
              f"{row['ttft_p99_ms']:.0f} | {row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} | {decode[C]:,.0f} "
              f"| {row['failed']} | {row['cpu_us_token']:.1f} |")
    print_steps(rows, str(logs / "events.log"))
    if a.http:
        from tests.serverproc import ServerProcess

        srv = ServerProcess(str(model), *argv[2:4], "--event-log", str(logs / "server-events.log"), *argv[6:], log_path=tmp / "server.log",
                            env={k: os.environ[k] for k in ("IMP_NULL_RUNNER", "IMP_NULL_STEP_US", "IMP_NULL_ROW_US",
                                                    "IMP_NULL_TOKEN_US", "IMP_NULL_MIXED_US", "IMP_NULL_BUCKETS",
                                                    "IMP_NULL_CTX_US", "IMP_NULL_PROMPT_CTX_US")
                                 if k in os.environ})
        import multiprocessing as mp

        peer = {}
        with mp.get_context("spawn").Pool(a.client_procs) as pool:
            try:
                srv.wait_ready(900)
                run_http_level(pool, srv.url, 1, 1, 16, 4, vocab, 1)  # warm
                http = [run_http_level(pool, srv.url, C, a.rounds, a.prompt, a.answer, vocab, a.client_procs,
                                       a.repetition_penalty)
                        for C in streams]
            finally:
                srv.stop()
            if a.llama_server:  # the peer on the same file and workload, -np = streams, a server a level
                from bench.serving import _stop, start_llama

                for C in [int(x) for x in a.llama_streams.split(",")] if a.llama_streams else streams:
                    try:
                        proc, url = start_llama(a.llama_server, str(model), C, a.device, a.llama_threads,
                                                logs / f"llama-{C}.log", per_slot=a.prompt + a.answer + 64)
                    except (RuntimeError, TimeoutError) as e:  # said in the table, the rest still measured
                        print(f"llama-server at {C} streams: {e}", file=sys.stderr)
                        continue
                    try:
                        run_http_level(pool, url, 1, 1, 16, 4, vocab, 1, peer=True)  # warm
                        peer[C] = run_http_level(pool, url, C, a.rounds, a.prompt, a.answer, vocab, a.client_procs,
                                                 a.repetition_penalty, peer=True)
                        print(f"llama-server {C} streams: {peer[C]['tok_s']:,.0f} tok/s", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001 - the peer's failure is reported with its log, imp's rows stand
                        log = (logs / f"llama-{C}.log").read_text(errors="replace").splitlines()
                        print(f"llama-server at {C} streams failed: {e!r}; its log ends:\n" + "\n".join(log[-25:]),
                              file=sys.stderr, flush=True)
                    finally:
                        _stop(proc)
        print(f"\nthe same workload through HTTP (`python -m imp` with the same flags, /v1/completions streamed, "
              f"{a.client_procs} client processes)" + (f"; llama-server beside (`-ngl 999 -np <streams>`, "
                                                       f"repeat_penalty {a.repetition_penalty:g})" if peer else ""))
        print("| streams | engine tok/s | HTTP tok/s | HTTP / engine | HTTP TTFT p50 / p99 ms | HTTP ITL p50 / p99 ms "
              "| failed |" + (" llama-server tok/s | imp / llama | llama TTFT p50 / p99 ms | llama ITL p50 / p99 ms |"
                              if peer else ""))
        print("|---|---|---|---|---|---|---|" + ("---|---|---|---|" if peer else ""))
        for row, h in zip(rows, http):
            row["http"] = h
            line = (f"| {row['streams']} | {row['tok_s']:,.0f} | {h['tok_s']:,.0f} | {h['tok_s'] / row['tok_s']:.2f} "
                    f"| {h['ttft_p50_ms']:.0f} / {h['ttft_p99_ms']:.0f} | {h['itl_p50_ms']:.1f} / {h['itl_p99_ms']:.1f} "
                    f"| {h['failed']} |")
            q = peer.get(row["streams"])
            if peer and q is None:
                line += " - | - | - | - |"
            elif peer:
                row["llama"] = q
                line += (f" {q['tok_s']:,.0f} | {h['tok_s'] / q['tok_s']:.2f} | {q['ttft_p50_ms']:.0f} / "
                         f"{q['ttft_p99_ms']:.0f} | {q['itl_p50_ms']:.1f} / {q['itl_p99_ms']:.1f} |")
            print(line)
        print("\nthrough HTTP, the engine's steps (the server's event log): the same sampler as the engine's levels")
        print_steps(http, str(logs / "server-events.log"))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
