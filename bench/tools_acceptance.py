"""Tool calling and structured outputs through the official SDKs, on a real model.

    .venv/bin/python bench/tools_acceptance.py [--model smollm2-135m] [--n 20] [--url URL]

Starts the server (unless --url), then through the `openai` and `anthropic` SDKs:
forced tool calls (OpenAI `required` and named, Anthropic `any` and `tool`), streamed
and not, each call's arguments validated against the tool's schema with jsonschema;
`json_schema` outputs validated; a `regex` output fullmatched; a GBNF output parsed;
`tool_choice: "none"` producing no call; a multi-turn agent loop (call -> tool result ->
answer) in both dialects. Prints one table row per check: passed / total.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "unit"]}},
    {"name": "search_flights", "description": "Search flights between two airports on a date",
     "parameters": {"type": "object", "properties": {
         "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
         "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
         "date": {"type": "string", "maxLength": 10}},
         "required": ["from", "to", "passengers"]}},
    {"name": "add_todo", "description": "Add an item to the todo list",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 60}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                             "maxItems": 3}},
         "required": ["title"]}},
]
PROMPTS = ["What's the weather like in Paris?", "Find me a flight from JFK to LHR for 2 people.",
           "Remind me to buy milk.", "Is it cold in Oslo today?", "Book a trip from SFO to NRT.",
           "Add 'call mom' to my list."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                       "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
OA_TOOLS = [{"type": "function", "function": t} for t in TOOLS]
AN_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]


def _valid(name: str, args) -> bool:
    try:
        jsonschema.validate(args, SCHEMAS[name])
        return True
    except jsonschema.ValidationError:
        return False


def openai_calls(oa, model: str, n: int, stream: bool, named: bool) -> tuple[int, int]:
    ok = 0
    for i in range(n):
        tool = TOOLS[i % len(TOOLS)]
        choice = {"type": "function", "function": {"name": tool["name"]}} if named else "required"
        kw = dict(model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tools=OA_TOOLS,
                  tool_choice=choice, max_tokens=160, temperature=0.7, seed=i)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for ch in oa.chat.completions.create(stream=True, **kw):
                if not ch.choices:
                    continue
                c = ch.choices[0]
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    d = calls.setdefault(tc.index, {"name": None, "args": ""})
                    if tc.function and tc.function.name:
                        d["name"] = tc.function.name
                    if tc.function and tc.function.arguments:
                        d["args"] += tc.function.arguments
            got = [(d["name"], d["args"]) for _, d in sorted(calls.items())]
        else:
            r = oa.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            got = [(tc.function.name, tc.function.arguments) for tc in r.choices[0].message.tool_calls or []]
        good = finish == "tool_calls" and bool(got) and all(
            _valid(name, json.loads(args)) and (not named or name == tool["name"]) for name, args in got)
        ok += good
    return ok, n


def anthropic_calls(an, model: str, n: int, stream: bool, named: bool) -> tuple[int, int]:
    ok = 0
    for i in range(n):
        tool = TOOLS[i % len(TOOLS)]
        choice = {"type": "tool", "name": tool["name"]} if named else {"type": "any"}
        kw = dict(model=model, max_tokens=160, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                  tools=AN_TOOLS, tool_choice=choice, extra_body={"temperature": 0.7})
        if stream:
            with an.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = an.messages.create(**kw)
        uses = [b for b in m.content if b.type == "tool_use"]
        good = m.stop_reason == "tool_use" and bool(uses) and all(
            _valid(b.name, b.input) and (not named or b.name == tool["name"]) and b.id.startswith("toolu_")
            for b in uses)
        ok += good
    return ok, n


def json_outputs(oa, model: str, n: int) -> tuple[int, int]:
    ok = 0
    for i in range(n):
        r = oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a fictional person as JSON."}], max_tokens=120,
            temperature=0.8, seed=100 + i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        try:
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, n


def regex_and_gbnf(oa, model: str) -> list[tuple[str, int, int]]:
    rx = r"[A-Z][a-z]{2,10} [0-9]{2}"
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "A name and an age."}],
                                   max_tokens=30, extra_body={"structured_outputs": {"regex": rx}})
    regex_ok = bool(re.fullmatch(rx, r.choices[0].message.content))
    g = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,40}'
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                   max_tokens=40, extra_body={"grammar": g})
    gbnf_ok = bool(re.fullmatch(r"(yes|no) because [a-z ]{3,40}", r.choices[0].message.content))
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}], tools=OA_TOOLS,
                                   tool_choice="none", max_tokens=30)
    none_ok = not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"
    return [("regex output fullmatches", int(regex_ok), 1), ("GBNF output parses", int(gbnf_ok), 1),
            ('tool_choice "none": no call', int(none_ok), 1)]


def agent_loops(oa, an, model: str) -> list[tuple[str, int, int]]:
    """call -> tool result -> answer, both dialects."""
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = oa.chat.completions.create(model=model, messages=msgs, tools=OA_TOOLS[:1], tool_choice="required",
                                   max_tokens=80, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    r2 = oa.chat.completions.create(model=model, messages=msgs, tools=OA_TOOLS[:1], max_tokens=60, temperature=0)
    oa_ok = r2.choices[0].finish_reason in ("stop", "length") and bool(r2.choices[0].message.content)
    amsgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = an.messages.create(model=model, max_tokens=80, messages=amsgs, tools=AN_TOOLS[:1],
                           tool_choice={"type": "any"}, extra_body={"temperature": 0})
    use = next(b for b in m.content if b.type == "tool_use")
    amsgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": json.dumps({"temp_c": 18, "sky": "clear"})}]}]
    m2 = an.messages.create(model=model, max_tokens=60, messages=amsgs, tools=AN_TOOLS[:1], extra_body={"temperature": 0})
    an_ok = m2.stop_reason in ("end_turn", "max_tokens") and any(b.type == "text" and b.text for b in m2.content)
    return [("agent loop, OpenAI (call, result, answer)", int(oa_ok), 1),
            ("agent loop, Anthropic (tool_use, tool_result, answer)", int(an_ok), 1)]


def run(url: str, model: str, n: int) -> list[tuple[str, int, int]]:
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=600)
    rows = []
    for stream in (False, True):
        for named in (False, True):
            what = ("named" if named else "required") + (", streamed" if stream else "")
            rows.append((f"OpenAI forced call ({what})", *openai_calls(oa, model, n, stream, named)))
            what = ("tool" if named else "any") + (", streamed" if stream else "")
            rows.append((f"Anthropic forced tool_use ({what})", *anthropic_calls(an, model, n, stream, named)))
    rows.append(("json_schema output validates", *json_outputs(oa, model, n)))
    rows += regex_and_gbnf(oa, model)
    rows += agent_loops(oa, an, model)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--url", default=None)
    a = ap.parse_args()
    srv = None
    url = a.url
    if url is None:
        from imp.fetch import resolve_model
        from tests.serverproc import ServerProcess

        srv = ServerProcess(str(resolve_model(a.model)), "--kv-cache-tokens", "8192")
        srv.wait_ready()
        url = srv.url
    t0 = time.time()
    try:
        rows = run(url, a.model, a.n)
    finally:
        if srv is not None:
            srv.stop()
    print(f"| check ({a.model}) | passed |")
    print("|---|---|")
    for name, ok, total in rows:
        print(f"| {name} | {ok}/{total} |")
    print(f"\n{sum(r[1] for r in rows)}/{sum(r[2] for r in rows)} in {time.time() - t0:.0f} s")
    return 0 if all(ok == total for _, ok, total in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
