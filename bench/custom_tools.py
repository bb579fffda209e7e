"""Custom tools on a running server: does every custom_tool_call's input parse under its grammar?

Through the official openai SDK (Responses), at temperature 0.8: for each grammar (a one-line
Lark grammar, a regex, Codex's real apply_patch grammar), each tool_choice mode (auto,
required, named) and stream / non-stream, N samples; every custom_tool_call input is parsed
with the `lark` package (or `re.fullmatch` for a regex). Prints a table: completed calls, those
whose input parses, replies cut by max_output_tokens (their call is marked incomplete). `tests/test_custom_tools_model.py` runs
it on SmolLM2; run it yourself against any server:

    python bench/custom_tools.py --url http://127.0.0.1:8080 --n 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import lark
import openai

ROOT = Path(__file__).resolve().parent.parent
APPLY_PATCH = json.loads((ROOT / "tests" / "data" / "codex_apply_patch_tool.json").read_text())["tool"]
GRAMMARS = {
    "greet (lark)": ({"type": "custom", "name": "greet", "description": "Greets a person by a number.",
                      "format": {"type": "grammar", "syntax": "lark",
                                 "definition": 'start: "hello " NUM\nNUM: /[0-9]{1,4}/\n'}},
                     "Greet person number 42 with the greet tool."),
    "zip (regex)": ({"type": "custom", "name": "zip_code", "description": "Looks up a US ZIP code.",
                     "format": {"type": "grammar", "syntax": "regex", "definition": r"[0-9]{5}(-[0-9]{4})?"}},
                    "Look up the ZIP code of Beverly Hills with the zip_code tool."),
    "apply_patch (lark)": (APPLY_PATCH, "In the file src/app.py, change the line `x = 1` to `x = 2`. Use apply_patch."),
}
MODES = ("auto", "required", "named")


def checker(tool: dict):
    fmt = tool["format"]
    if fmt["syntax"] == "regex":
        rx = re.compile(fmt["definition"])
        return lambda s: rx.fullmatch(s) is not None
    parser = lark.Lark(fmt["definition"], start="start")

    def ok(s: str) -> bool:
        for text in (s, s + "\n"):  # a grammar ending in an optional LF may stop before it
            try:
                parser.parse(text)
                return True
            except lark.exceptions.LarkError:
                pass
        return False
    return ok


async def one(sdk, tool: dict, prompt: str, mode: str, stream: bool, max_tokens: int) -> tuple[list[str], bool]:
    choice = {"type": "custom", "name": tool["name"]} if mode == "named" else mode
    kw = dict(model="m", input=prompt, tools=[tool], tool_choice=choice, temperature=0.8, store=False,
              max_output_tokens=max_tokens)
    if stream:
        deltas: dict[str, str] = {}
        r = None
        async for e in await sdk.responses.create(**kw, stream=True):
            if e.type == "response.custom_tool_call_input.delta":
                deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
            elif e.type in ("response.completed", "response.incomplete", "response.failed"):
                r = e.response
        for it in r.output:  # the streamed deltas spell the final input
            if it.type == "custom_tool_call":
                assert deltas.get(it.id, "") == it.input, (deltas, it.input)
    else:
        r = await sdk.responses.create(**kw)
    calls = [it for it in r.output if it.type == "custom_tool_call"]
    # a call max_output_tokens cut is marked incomplete: only the completed ones must parse
    return [it.input for it in calls if it.status == "completed"], r.status == "incomplete"


async def run(url: str, n: int, concurrency: int, max_tokens: int, names=None) -> list[dict]:
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    rows = []
    for gname, (tool, prompt) in GRAMMARS.items():
        if names and gname.split()[0] not in names:
            continue
        ok = checker(tool)
        for mode in MODES:
            for stream in (False, True):
                async def task():
                    async with sem:
                        return await one(sdk, tool, prompt, mode, stream, max_tokens)
                t0 = time.monotonic()
                got = await asyncio.gather(*(task() for _ in range(n)))
                inputs = [i for calls, _ in got for i in calls]
                rows.append({"grammar": gname, "mode": mode, "stream": stream, "samples": n, "calls": len(inputs),
                             "parsed": sum(ok(i) for i in inputs), "cut": sum(cut for _, cut in got),
                             "bad": [i for i in inputs if not ok(i)][:2], "s": round(time.monotonic() - t0, 1)})
    await sdk.close()
    return rows


def table(rows: list[dict]) -> str:
    out = ["| grammar | tool_choice | stream | samples | completed calls | inputs that parse | cut by max_output_tokens | s |",
           "|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['grammar']} | {r['mode']} | {r['stream']} | {r['samples']} | {r['calls']} | {r['parsed']} | "
            f"{r['cut']} | {r['s']} |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", help="grammar names (greet, zip, apply_patch)")
    a = ap.parse_args()
    rows = asyncio.run(run(a.url, a.n, a.concurrency, a.max_tokens, a.only))
    print(table(rows))
    for r in rows:
        if r["bad"]:
            print(r["grammar"], r["mode"], r["stream"], "unparsed:", [b[:200] for b in r["bad"]])


if __name__ == "__main__":
    main()
