"""Draft-free speculative decoding: the speed-up where the answer copies the prompt, and no loss where it does not.

imp's suffix / n-gram proposer drafts tokens from the request's own prompt and output and
the model verifies several of them in one step; a request turns it on or off with the body
field `"speculative": true|false` (chat completions). This benchmark sends three workloads
of greedy chat requests (temperature 0, fixed seed) through the streaming API:

  code   --prompts (20) Python files from this repository's own imp/ tree (sorted file list
         at HEAD, a 100-300 line slice of each, at most --max-chars characters; the same on
         every run of one commit) with an instruction to return the whole file with one small
         change (rename a function or class, add a comment line at the top or the end),
         only the code
  tool   the same kind of file, saved through a forced tool call: `tools` holds one function
         write_file(path, content), `tool_choice` names it, and the answer's `content`
         argument quotes the file with a one-line change (tokens counted from usage)
  prose  short prompts for an original story or essay on varied topics: nothing to copy
         (sampled at --prose-temperature 0.8 with a fixed seed: greedy, a small model's prose
         soon loops, and a loop is something to copy)

and measures, per request, completion tokens, wall time, TTFT and decode tok/s =
(completion tokens - 1) / (last token time - first token time); per workload the
aggregate tok/s = all completion tokens / wall of the whole workload. At --streams C it
keeps C requests in flight (a finished one replaced by the next prompt) until every
prompt is done; the list repeats when it has fewer prompts than C.

imp sends a forced tool call whole when it ends, so its tool rows' TTFT is the time to
the whole call and they have no decode tok/s. llama-server reads a named tool_choice
object as "auto"; --llama-tool-choice required sends "required" instead (in the build
tried, with SmolLM2, that put no tools in the prompt and decoded at about 1 tok/s under
a grammar, still answering in text).

Servers and modes, for every --streams setting:
  imp, started once per setting (or --url: one already running); every workload with
      "speculative": false and then true (--imp-modes; a 400 for `true`, as before the
      feature lands, gives an error row and the run goes on)
  llama-server (--llama-server PATH), started once per (spec type, streams): --spec-type
      none and each of --llama-spec-types (default ngram-simple), -np = streams,
      -c = streams x (longest prompt + answer), -t = --threads, --jinja

Before each measured pass every prompt of the workload is sent once with max_tokens 1
(same concurrency), so each pass starts with the prompts in the prefix cache as far as
it holds them: the mode measured second does not get a warmer cache than the first
(imp's modes share one server). --no-prime skips that (then TTFT is cold for the first
pass only). usage.prompt_tokens_details.cached_tokens in the JSON shows what was reused.
Only one server runs at a time. On a shared box, read the load average printed at both
ends: llama-server's threads wait by spinning, and another process on one of its cores
slowed it from about 80 to 1 tok/s in a run here (imp's thread governor drops to one thread).

The table (printed at the end, and --json FILE with every row, its requests and the
lscpu flags line) has one row per (workload, streams, server + mode): aggregate tok/s,
median per-request decode tok/s, TTFT p50, speed-up (aggregate, and decode p50) against
the same server with speculation off, acceptance (imp: sum imp_spec_accepted / sum
imp_spec_drafted from usage.completion_tokens_details, and emitted tokens per verify step;
llama-server: draft_n_accepted / draft_n from its `timings`), "same" = how many outputs
are identical to the same prompt's output with speculation off (greedy: all of them
should be), and copy% = the share of the answer's non-blank lines found verbatim in the
prompt's code (does the model copy at all?).

    .venv/bin/python bench/spec.py                                   # imp, off and on, streams 1 and 16
    .venv/bin/python bench/spec.py --llama-server /tmp/llama-cpp-native/build/bin/llama-server \\
        --llama-spec-types ngram-simple,ngram-mod --json /tmp/spec.json
    .venv/bin/python bench/spec.py --workloads code,prose --prompts 2 --max-tokens 64 --streams 1 \\
        --imp-modes off --llama-server /tmp/llama-cpp-native/build/bin/llama-server   # a quick check
    .venv/bin/python bench/spec.py --url http://127.0.0.1:8080 --streams 1               # a running imp

Flags: --model (imp name such as smollm2-135m / gemma-3-270m, or a GGUF path; llama-server
gets the file), --workloads code,tool,prose, --prompts N, --max-tokens 512, --streams 1,16,
--imp-modes off,on (or none), --server-args "..." (extra imp flags, e.g. --kv-cache-tokens:
imp's default pool holds about 16K tokens, so at 16 streams of 3K-token prompts requests
queue), --threads (both servers; default: the CPUs this process may use),
--llama-spec-types, --llama-ngram-n/--llama-ngram-m (--spec-ngram-simple-size-n/-m),
--llama-args "...", --llama-tool-choice as-is|required, --seed, --max-chars, --no-prime,
--json FILE (rows with every request, its text included), --log-dir DIR (server logs).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.serverproc import ServerProcess, free_port  # noqa: E402

WORKLOADS = ("code", "tool", "prose")
SPEC_FIELDS = ("imp_spec_drafted", "imp_spec_accepted", "imp_spec_emitted", "imp_spec_verify_steps")
GGUF = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf"}


# ---------------------------------------------------------------------------------------------
# the machine

def cpu_line() -> str:
    """CPU model, CPU count and the SIMD flags that matter here (from lscpu, else /proc/cpuinfo)."""
    want = re.compile(r"^(avx2|fma|f16c|avx512\w*|avx_vnni\w*|amx\w*)$")
    model, flags = "?", []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for ln in out.splitlines():
            k, _, v = ln.partition(":")
            if k.strip() == "Model name":
                model = v.strip()
            elif k.strip() == "Flags":
                flags = v.split()
    except (OSError, subprocess.SubprocessError):
        pass
    if not flags:
        try:
            text = Path("/proc/cpuinfo").read_text()
            flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        except OSError:
            pass
    return f"{model}, {n_cpus()} CPUs, flags: {' '.join(f for f in flags if want.match(f)) or '(none)'}"


def n_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ---------------------------------------------------------------------------------------------
# the workloads

def _sources() -> list[tuple[str, list[str]]]:
    """(path, lines) of imp/'s Python files of 100+ lines, sorted by path: from git HEAD (so
    other people's uncommitted edits do not change the prompts), else the working tree."""
    out = []
    try:
        names = subprocess.run(["git", "ls-files", "imp/*.py"], cwd=ROOT, capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()
        for name in sorted(names):
            r = subprocess.run(["git", "show", f"HEAD:{name}"], cwd=ROOT, capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                out.append((name, r.stdout.splitlines()))
    except (OSError, subprocess.SubprocessError):
        out = []
    if not out:
        out = [(str(p.relative_to(ROOT)), p.read_text(errors="replace").splitlines())
               for p in sorted(ROOT.glob("imp/**/*.py"))]
    return [(n, ls) for n, ls in out if len(ls) >= 100]


def _slice(lines: list[str], i: int, max_chars: int) -> list[str]:
    """A 100-300 line slice (its length and start vary with i), cut to max_chars but not below 100 lines."""
    n = min(len(lines), 100 + (i * 53) % 201)
    start = (len(lines) - n) * ((i * 7) % 10) // 10
    part = lines[start:start + n]
    while len(part) > 100 and sum(len(s) + 1 for s in part) > max_chars:
        part = part[:-1]
    return part


def _change(code: list[str], k: int) -> str:
    """One small edit to ask for; the kind varies with k."""
    text = "\n".join(code)
    funcs = re.findall(r"^\s*(?:async\s+)?def\s+([A-Za-z_]\w*)\s*\(", text, re.M)
    classes = re.findall(r"^\s*class\s+([A-Za-z_]\w*)", text, re.M)
    kind = k % 4
    if kind == 0 and funcs:
        f = funcs[len(funcs) // 2]
        return f"Rename the function `{f}` to `{f}_v2` (its definition and every call)."
    if kind == 2 and classes:
        return f"Rename the class `{classes[0]}` to `{classes[0]}Impl` everywhere."
    if kind == 3:
        return "Add the comment line `# end of file` as the last line."
    return "Add the comment line `# Reviewed for the benchmark.` as the first line."


def _slices(count: int, max_chars: int, offset: int) -> list[tuple[str, list[str], int]]:
    """count slices of evenly spread files; offset shifts the pick (tool uses other files than code)."""
    files = _sources()
    out = []
    for i in range(count):
        idx = ((2 * i + offset) * len(files)) // (2 * max(count, 20)) % len(files)
        name, lines = files[idx]
        out.append((name, _slice(lines, i + offset, max_chars), i))
    return out


TOOLS = [{"type": "function", "function": {
    "name": "write_file",
    "description": "Write a text file to disk, replacing it if it exists.",
    "parameters": {"type": "object",
                   "properties": {"path": {"type": "string", "description": "where to save it"},
                                  "content": {"type": "string", "description": "the whole file"}},
                   "required": ["path", "content"]}}}]

TOPICS = [
    "a lighthouse keeper who finds a message in a bottle", "why cities should plant more trees",
    "a robot learning to bake bread", "the history of the bicycle", "a dragon afraid of heights",
    "the value of boredom", "two rival beekeepers", "what makes a good teacher",
    "a train that never stops", "the ethics of zoos", "a child who can talk to clocks",
    "why people collect things", "the last bookshop on the moon", "learning a second language as an adult",
    "a detective who solves crimes by smell", "the importance of sleep", "a village where it always rains",
    "how maps changed the world", "a musician who loses her hearing", "the joy of walking",
]


@dataclass
class Prompt:
    messages: list[dict]
    extra: dict = field(default_factory=dict)  # tools, tool_choice
    source: str = ""  # the code the answer may copy ("" for prose)
    label: str = ""


def build(workload: str, count: int, max_chars: int, prose_temperature: float = 0.8) -> list[Prompt]:
    if workload == "code":
        out = []
        for name, code, i in _slices(count, max_chars, 0):
            src = "\n".join(code)
            msg = (f"Here is a Python file, `{name}`:\n\n```python\n{src}\n```\n\n{_change(code, i)} "
                   "Return the whole file with only that change, as a single ```python code block, and nothing else.")
            out.append(Prompt([{"role": "user", "content": msg}], source=src, label=name))
        return out
    if workload == "tool":
        out = []
        for name, code, i in _slices(count, max_chars, 1):
            src = "\n".join(code)
            msg = (f"Save the following Python file under the path `out/{Path(name).name}` with the write_file "
                   f"tool, with one change: {_change(code, i + 1)} Apart from that, `content` must be the file "
                   f"exactly as it is.\n\n```python\n{src}\n```")
            out.append(Prompt([{"role": "user", "content": msg}],
                              {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "write_file"}}},
                              source=src, label=name))
        return out
    if workload == "prose":
        forms = ["Write an original short story about {t}.", "Write a short essay on {t}.",
                 "Tell me an original fable about {t}, with a moral at the end.",
                 "Write a reflective blog post about {t}."]
        # sampled (seeded): a small model's greedy prose soon loops, and a loop is something to copy
        return [Prompt([{"role": "user", "content": forms[i % len(forms)].format(t=TOPICS[i % len(TOPICS)])}],
                       {"temperature": prose_temperature} if prose_temperature else {},
                       label=TOPICS[i % len(TOPICS)]) for i in range(count)]
    raise SystemExit(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")


def copy_share(text: str, source: str) -> float | None:
    """The share of the answer's non-blank lines that appear verbatim (stripped) in the source."""
    if not source:
        return None
    src = {ln.strip() for ln in source.splitlines() if ln.strip()}
    out = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("```")]
    return sum(ln in src for ln in out) / len(out) if out else 0.0


# ---------------------------------------------------------------------------------------------
# the client

async def one_request(session, url: str, p: Prompt, max_tokens: int, seed: int, extra: dict) -> dict:
    body = {"model": "bench", "messages": p.messages, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, **p.extra, **extra}
    t0 = time.perf_counter()
    first = last = None
    usage, timings, finish = None, None, None
    content, calls = [], {}
    events = 0  # chunks that carried output
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:300]}"}
        buf = b""
        done = False
        async for raw in resp.content.iter_any():  # not line iteration: a whole tool call can be one long line
            buf += raw
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line = line.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return {"error": json.dumps(chunk["error"])[:300]}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("timings"):
                    timings = chunk["timings"]
                for ch in chunk.get("choices") or []:
                    d = ch.get("delta") or {}
                    got = False
                    for key in ("reasoning_content", "content"):
                        if d.get(key):
                            content.append(d[key])
                            got = True
                    for tc in d.get("tool_calls") or []:
                        c = calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                        fn = tc.get("function") or {}
                        c["name"] += fn.get("name") or ""
                        c["arguments"] += fn.get("arguments") or ""
                        got = True
                    if got:
                        events += 1
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
            if done:
                break
    end = time.perf_counter()
    text = "".join(content)
    answer = text  # what copy_share reads: the text, or a written file's content
    for i in sorted(calls):
        c = calls[i]
        text += f"\n<call {c['name']}>{c['arguments']}"
        try:
            answer += "\n" + str(json.loads(c["arguments"]).get("content", ""))
        except (ValueError, AttributeError):
            answer += "\n" + c["arguments"]
    n = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None else None
    details = (usage or {}).get("completion_tokens_details") or {}
    spec = {k: int(details[k]) for k in SPEC_FIELDS if isinstance(details.get(k), (int, float))}
    if timings and timings.get("draft_n"):
        spec["llama_draft_n"] = int(timings["draft_n"])
        spec["llama_draft_accepted"] = int(timings.get("draft_n_accepted") or 0)
    decode_s = (last - first) if first is not None and last is not None else 0.0
    return {
        "tokens": n if n is not None else len(content),
        "tokens_from_usage": n is not None,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
        "wall_s": end - t0,
        "ttft_s": (first if first is not None else end) - t0,
        # None where the answer came in one or two pieces (imp sends a forced tool call whole, at its end)
        "decode_tok_s": (n - 1) / decode_s if n and n > 1 and decode_s > 0 and events >= 3 else None,
        "events": events,
        "finish": finish,
        "spec": spec,
        "copy": copy_share(answer, p.source),
        "text": text,
    }


def _session():
    import aiohttp

    # a fresh connection per request: llama-server drops idle keep-alive connections, and a
    # reused dead one reads as "Server disconnected" (as in bench/cpu_serving.py)
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=900),
                                 connector=aiohttp.TCPConnector(force_close=True, limit=0))


async def run_pass(url: str, prompts: list[Prompt], streams: int, max_tokens: int, seed: int,
                   extra: dict) -> tuple[list[dict], float]:
    """C workers over the job list (prompts, repeated to at least C jobs): (results by job, wall)."""
    jobs = [prompts[j % len(prompts)] for j in range(max(len(prompts), streams))]
    results: list[dict | None] = [None] * len(jobs)
    nxt = iter(range(len(jobs)))

    async with _session() as s:
        async def worker():
            for j in nxt:
                try:
                    results[j] = await one_request(s, url, jobs[j], max_tokens, seed, extra)
                except Exception as e:  # noqa: BLE001 - one failed request is a row's note, not a crash
                    results[j] = {"error": f"{type(e).__name__}: {e}"}

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - t0
    return results, wall


async def prime(url: str, prompts: list[Prompt], streams: int, seed: int, extra: dict) -> None:
    """Each prompt once with max_tokens 1 (errors ignored): the prefix cache holds them before a pass."""
    sem = asyncio.Semaphore(streams)

    async with _session() as s:
        async def one(p: Prompt):
            body = {"model": "bench", "messages": p.messages, "max_tokens": 1, "temperature": 0, "seed": seed,
                    **p.extra, **extra}
            async with sem:
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                except Exception:  # noqa: BLE001
                    pass
        await asyncio.gather(*(one(p) for p in prompts))


WARM = ("Repeat these lines exactly, twice:\n" + "\n".join(
    f"def step_{i}(x):\n    return x * {i} + {i * i}" for i in range(6)))


async def warm_up(url: str, extra: dict) -> None:
    """A short copy task, so a speculative path's first verify step is not in the measured pass."""
    async with _session() as s:
        try:
            await one_request(s, url, Prompt([{"role": "user", "content": WARM}]), 48, 0, extra)
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------------------
# the servers

class Llama:
    """llama-server on the same GGUF; /health 200 = ready."""

    def __init__(self, binary: str, model: Path, spec_type: str, streams: int, ctx_per_slot: int, threads: int,
                 ngram_n: int | None, ngram_m: int | None, extra: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-np", str(streams), "-c", str(ctx_per_slot * streams), "--jinja", "--spec-type", spec_type]
        if spec_type == "ngram-simple":
            cmd += (["--spec-ngram-simple-size-n", str(ngram_n)] if ngram_n else []) + \
                   (["--spec-ngram-simple-size-m", str(ngram_m)] if ngram_m else [])
        cmd += extra
        self.cmd = cmd
        self.out = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_bytes()[-2000:].decode(errors="replace"))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"llama-server not ready in {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.out.close()


def gguf_path(model: str) -> Path:
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from imp.fetch import resolve_model

        return Path(resolve_model(model))
    except Exception:  # noqa: BLE001 - fall back to the cache's known file names
        if model in GGUF:
            return Path.home() / ".cache" / "imp" / GGUF[model]
        raise


# ---------------------------------------------------------------------------------------------
# rows

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def make_row(workload: str, streams: int, server: str, mode: str, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r and "error" not in r]
    errors = [r["error"] for r in results if r and "error" in r]
    spec_sum = {}
    for r in ok:
        for k, v in r["spec"].items():
            spec_sum[k] = spec_sum.get(k, 0) + v
    toks = sum(r["tokens"] for r in ok)
    row = {
        "workload": workload, "streams": streams, "server": server, "mode": mode,
        "requests": len(results), "ok": len(ok), "errors": errors[:3], "n_errors": len(errors),
        "completion_tokens": toks, "wall_s": wall,
        "agg_tok_s": toks / wall if ok and wall > 0 else None,
        "decode_tok_s_p50": _median(r["decode_tok_s"] for r in ok),
        "ttft_ms_p50": 1000 * _median(r["ttft_s"] for r in ok) if ok else None,
        "prompt_tokens_p50": _median(r["prompt_tokens"] for r in ok),
        "copy_p50": _median(r["copy"] for r in ok),
        "finish": {str(f): sum(r["finish"] == f for r in ok) for f in sorted({str(r["finish"]) for r in ok})},
        "spec": spec_sum,
        "acceptance": None, "tokens_per_step": None,
        "speedup": None, "decode_speedup": None, "same": None,
        "requests_detail": [r for r in results if r],  # text included: the JSON shows what the model wrote
    }
    if spec_sum.get("imp_spec_drafted"):
        row["acceptance"] = spec_sum.get("imp_spec_accepted", 0) / spec_sum["imp_spec_drafted"]
    elif spec_sum.get("llama_draft_n"):
        row["acceptance"] = spec_sum.get("llama_draft_accepted", 0) / spec_sum["llama_draft_n"]
    if spec_sum.get("imp_spec_verify_steps"):
        row["tokens_per_step"] = spec_sum.get("imp_spec_emitted", 0) / spec_sum["imp_spec_verify_steps"]
    row["_texts"] = [r.get("text") if r and "error" not in r else None for r in results]
    return row


def compare(row: dict, base: dict) -> None:
    """Speed-ups and identical outputs against the same server's speculation-off row."""
    if row is base:
        return
    if row["agg_tok_s"] and base["agg_tok_s"]:
        row["speedup"] = row["agg_tok_s"] / base["agg_tok_s"]
    if row["decode_tok_s_p50"] and base["decode_tok_s_p50"]:
        row["decode_speedup"] = row["decode_tok_s_p50"] / base["decode_tok_s_p50"]
    pairs = [(a, b) for a, b in zip(row["_texts"], base["_texts"]) if a is not None and b is not None]
    row["same"] = [sum(a == b for a, b in pairs), len(pairs)]


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def print_table(rows: list[dict]) -> None:
    print("\n| workload | streams | server | mode | req | tokens | agg tok/s | decode tok/s p50 | TTFT p50 ms "
          "| speed-up agg (decode) | accepted/drafted | tok/step | same output | copy% p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["ok"] == 0:
            print(f"| {r['workload']} | {r['streams']} | {r['server']} | {r['mode']} | {r['requests']} | - | - | - | - "
                  f"| - | - | - | - | all {r['n_errors']} failed: {r['errors'][0][:80] if r['errors'] else '?'} |")
            continue
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x ({_f(r['decode_speedup'], '{:.2f}x')})"
        same = "-" if r["same"] is None else f"{r['same'][0]}/{r['same'][1]}"
        err = f" ({r['n_errors']} failed)" if r["n_errors"] else ""
        print(f"| {r['workload']} | {r['streams']} | {r['server']} | {r['mode']} | {r['ok']}{err} "
              f"| {r['completion_tokens']} | {_f(r['agg_tok_s'])} | {_f(r['decode_tok_s_p50'])} "
              f"| {_f(r['ttft_ms_p50'], '{:.0f}')} | {sp} | {_f(r['acceptance'], '{:.2f}')} "
              f"| {_f(r['tokens_per_step'], '{:.2f}')} | {same} | {_f(r['copy_p50'] and 100 * r['copy_p50'], '{:.0f}')} |")


def note(row: dict) -> None:
    """One progress line while the run goes on."""
    if row["ok"] == 0:
        print(f"  {row['workload']:5} x{row['streams']:<2} {row['server']} {row['mode']}: all "
              f"{row['n_errors']} failed: {row['errors'][0][:160] if row['errors'] else '?'}", flush=True)
        return
    print(f"  {row['workload']:5} x{row['streams']:<2} {row['server']} {row['mode']}: {row['ok']} requests, "
          f"{row['completion_tokens']} tokens in {row['wall_s']:.1f}s = {_f(row['agg_tok_s'])} tok/s, "
          f"decode p50 {_f(row['decode_tok_s_p50'])}, TTFT p50 {_f(row['ttft_ms_p50'], '{:.0f}')} ms, "
          f"prompt p50 {_f(row['prompt_tokens_p50'], '{:.0f}')} tokens"
          + (f", {row['n_errors']} failed: {row['errors'][0][:120]}" if row["n_errors"] else ""), flush=True)


# ---------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="imp model name or GGUF path (llama-server gets the file)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=20, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--streams", default="1,16", help="concurrency levels")
    ap.add_argument("--imp-modes", default="off,on", help="'off,on', 'off', 'on' or 'none' (no imp)")
    ap.add_argument("--url", default=None, help="measure this running imp instead of starting one")
    ap.add_argument("--server-args", default="", help="extra flags for the imp server")
    ap.add_argument("--threads", type=int, default=n_cpus(), help="threads for both servers")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: measure it too")
    ap.add_argument("--llama-spec-types", default="ngram-simple",
                    help="llama-server --spec-type values beside 'none' (comma list)")
    ap.add_argument("--llama-ngram-n", type=int, default=None, help="--spec-ngram-simple-size-n (server default 12)")
    ap.add_argument("--llama-ngram-m", type=int, default=None, help="--spec-ngram-simple-size-m (server default 48)")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags")
    ap.add_argument("--llama-tool-choice", choices=("as-is", "required"), default="as-is",
                    help="tool workload: send llama-server the named tool_choice object as is (it reads it as "
                         "'auto'), or 'required'")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-chars", type=int, default=9000, help="cap on a code slice's characters (>= 100 lines kept)")
    ap.add_argument("--prose-temperature", type=float, default=0.8,
                    help="the prose workload samples (seeded) at this temperature: greedy, a small model's prose "
                         "soon loops, which is something to copy (0 = greedy)")
    ap.add_argument("--no-prime", action="store_true", help="no max_tokens-1 pass before each measured pass")
    ap.add_argument("--json", default=None, help="write every row (and the lscpu flags line) here")
    ap.add_argument("--log-dir", default="/tmp", help="server logs go here")
    ns = ap.parse_args()

    workloads = [w for w in ns.workloads.split(",") if w]
    levels = [int(k) for k in ns.streams.split(",") if k]
    modes = [] if ns.imp_modes.strip() in ("", "none") else [m.strip() for m in ns.imp_modes.split(",")]
    if any(m not in ("off", "on") for m in modes):
        ap.error("--imp-modes takes off and/or on, or none")
    spec_types = [t for t in ns.llama_spec_types.split(",") if t and t != "none"]
    prompts = {w: build(w, ns.prompts, ns.max_chars, ns.prose_temperature) for w in workloads}
    digest = hashlib.sha256(json.dumps({w: [p.messages for p in ps] for w, ps in prompts.items()},
                                       sort_keys=True).encode()).hexdigest()[:12]
    cpu = cpu_line()
    log_dir = Path(ns.log_dir)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {cpu}  load average {os.getloadavg()[0]:.1f}")
    print(f"model {ns.model}, commit {git_commit() or '?'}, workloads {','.join(workloads)} x {ns.prompts} prompts "
          f"(digest {digest}), max_tokens {ns.max_tokens}, streams {ns.streams}, threads {ns.threads}, "
          f"greedy seed {ns.seed}, {'no priming' if ns.no_prime else 'prompts primed before each pass'}", flush=True)

    rows: list[dict] = []

    def measure(url: str, server: str, mode: str, extra: dict, streams: int, workload: str) -> dict:
        ps = prompts[workload]
        if server == "llama-server" and ns.llama_tool_choice == "required":
            # llama-server's tool_choice is a string (an object reads as "auto"); one tool, so "required" is the same
            ps = [replace(p, extra={**p.extra, "tool_choice": "required"}) if "tool_choice" in p.extra else p
                  for p in ps]
        if not ns.no_prime:
            asyncio.run(prime(url, ps, streams, ns.seed, extra))
        results, wall = asyncio.run(run_pass(url, ps, streams, ns.max_tokens, ns.seed, extra))
        row = make_row(workload, streams, server, mode, results, wall)
        note(row)
        rows.append(row)
        return row

    def imp_level(url: str, streams: int) -> None:
        for m in modes:
            asyncio.run(warm_up(url, {"speculative": m == "on"}))
        for w in workloads:
            got = {m: measure(url, "imp", m, {"speculative": m == "on"}, streams, w) for m in modes}
            if "off" in got and "on" in got:
                compare(got["on"], got["off"])

    # -c: every slot holds its longest prompt (chars / 2.5, a bound for code tokens) + the answer + a margin
    longest = max((len(json.dumps(p.messages)) + len(json.dumps(p.extra)) for ps in prompts.values() for p in ps),
                  default=0)
    ctx_per_slot = ((int(longest / 2.5) + ns.max_tokens + 512) + 255) // 256 * 256
    gguf = gguf_path(ns.model) if ns.llama_server else None

    live: list = []
    failed = False
    try:
        for streams in levels:
            print(f"\n== streams {streams}", flush=True)
            if modes:
                if ns.url:
                    imp_level(ns.url.rstrip("/"), streams)
                else:
                    args = (["--threads", str(ns.threads)] if "--threads" not in ns.server_args else []) \
                        + shlex.split(ns.server_args)
                    srv = ServerProcess(ns.model, *args, log_path=log_dir / f"imp-spec-bench-{streams}.log")
                    live.append(srv)
                    srv.wait_ready(600)
                    print(f"imp {ns.model} {' '.join(args)} on {srv.url} (log {srv.log_path})", flush=True)
                    imp_level(srv.url, streams)
                    srv.stop()
                    live.remove(srv)
            if ns.llama_server:
                base = {}
                for st in ["none", *spec_types]:
                    ll = Llama(ns.llama_server, gguf, st, streams, ctx_per_slot, ns.threads, ns.llama_ngram_n,
                               ns.llama_ngram_m, shlex.split(ns.llama_args),
                               log_dir / f"llama-spec-bench-{st}-{streams}.log")
                    live.append(ll)
                    ll.wait_ready(600)
                    print(f"llama-server --spec-type {st}: {' '.join(ll.cmd[1:])} (log {ll.log_path})", flush=True)
                    asyncio.run(warm_up(ll.url, {}))
                    for w in workloads:
                        row = measure(ll.url, "llama-server", st, {}, streams, w)
                        if st == "none":
                            base[w] = row
                        elif w in base:
                            compare(row, base[w])
                    ll.stop()
                    live.remove(ll)
    except KeyboardInterrupt:
        print("\ninterrupted: the table holds the rows measured so far", flush=True)
        failed = True
    except Exception:  # noqa: BLE001 - a server that would not start: still print what was measured
        import traceback

        traceback.print_exc()
        print("\nstopped by the error above: the table holds the rows measured so far", flush=True)
        failed = True
    finally:
        for s in reversed(live):
            try:
                s.stop()
            except Exception as e:  # noqa: BLE001
                print(f"stopping a server: {e}", file=sys.stderr)

    order = {w: i for i, w in enumerate(workloads)}
    rows.sort(key=lambda r: (order[r["workload"]], r["streams"]))  # stable: server and mode in run order
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  {cpu}  load average {os.getloadavg()[0]:.1f} "
          "(other processes on the cores skew every number)")
    print(f"model {ns.model}, max_tokens {ns.max_tokens}, {ns.prompts} prompts a workload, greedy; "
          "speed-up = against the same server with speculation off; same output = identical text to that row's")
    print_table(rows)
    if ns.json:
        for r in rows:
            r.pop("_texts", None)
        Path(ns.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "lscpu": cpu, "commit": git_commit(), "prompts_digest": digest,
            "args": vars(ns), "rows": rows}, indent=1))
        print(f"\nwrote {ns.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
