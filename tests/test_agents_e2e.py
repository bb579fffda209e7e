"""Tools, structured outputs and Responses on the real model, through the official SDKs.

One server (SmolLM2 on CPU, an event log, a store in tmp): forced tool calls in both
dialects validate against their schemas (stream and not), json_schema / regex / GBNF
outputs match, tool_choice none makes no call, the Responses API round-trips with its
store (chain of three, retrieve, delete, store: false), and at the end the event log of
all of it — constrained and tool-calling requests included — replays identical.
The full 20-per-check table is `bench/tools_acceptance.py` (PERFORMANCE.md quotes it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tools_acceptance as acc

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    from tests.serverproc import ServerProcess

    d = tmp_path_factory.mktemp("agents")
    srv = ServerProcess(smollm2_path, "--kv-cache-tokens", "8192", "--event-log", str(d / "events.log"),
                        "--responses-store", str(d / "responses.sqlite3"), log_path=d / "server.out")
    srv.event_log = d / "events.log"
    with srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server):
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    an = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=600)
    return oa, an


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("named", [False, True])
def test_forced_tool_calls_validate_in_both_dialects(clients, stream, named):
    oa, an = clients
    assert acc.openai_calls(oa, "smollm2", 3, stream, named) == (3, 3)
    assert acc.anthropic_calls(an, "smollm2", 3, stream, named) == (3, 3)


def test_structured_outputs_validate(clients):
    oa, _ = clients
    assert acc.json_outputs(oa, "smollm2", 3) == (3, 3)
    for name, ok, total in acc.regex_and_gbnf(oa, "smollm2"):
        assert ok == total, name


def test_responses_round_trip_with_the_store(clients):
    import openai

    oa, _ = clients
    r1 = oa.responses.create(model="smollm2", input="Name a fruit.", max_output_tokens=16, temperature=0)
    assert r1.status in ("completed", "incomplete") and r1.output_text
    r2 = oa.responses.create(model="smollm2", input="Another one.", previous_response_id=r1.id, max_output_tokens=16)
    r3 = oa.responses.create(model="smollm2", input="And a third.", previous_response_id=r2.id, max_output_tokens=16)
    assert r3.usage.input_tokens > r1.usage.input_tokens  # the chain's turns are in the prompt
    assert r3.usage.input_tokens_details.cached_tokens > 0  # and their prefix came from the cache
    assert oa.responses.retrieve(r2.id).output_text == r2.output_text
    assert [i.content[0].text for i in oa.responses.input_items.list(r3.id).data] == ["And a third."]
    oa.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r1.id)
    r = oa.responses.create(model="smollm2", input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r.id)
    text, final = "", None
    with oa.responses.stream(model="smollm2", input="Count to three.", max_output_tokens=12) as s:
        for e in s:
            if e.type == "response.output_text.delta":
                text += e.delta
            elif e.type in ("response.completed", "response.incomplete"):  # a cut reply ends "incomplete"
                final = e.response
    assert final is not None and text == final.output_text and final.status in ("completed", "incomplete")


def test_responses_function_tool_round_trip(clients):
    oa, _ = clients
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather for a city",
              "parameters": acc.SCHEMAS["get_weather"]}]
    r = oa.responses.create(model="smollm2", input="What's the weather in Paris?", tools=tools,
                            tool_choice="required", max_output_tokens=80, temperature=0)
    fc = next(it for it in r.output if it.type == "function_call")
    assert acc._valid("get_weather", json.loads(fc.arguments))
    r2 = oa.responses.create(model="smollm2", tools=tools, tool_choice="none", max_output_tokens=30, input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp_c": 18, "sky": "clear"}'}])
    assert r2.output_text and not any(it.type == "function_call" for it in r2.output)


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_runs_a_one_tool_agent(server, api):
    """The Agents SDK (Responses by default, and its Chat Completions model): tool call, the
    tool's result back, a final answer within max_turns."""
    agents = pytest.importorskip("agents")
    import asyncio

    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return f"The weather in {city} is 18 C and clear."

    async def go():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                             tools=[get_weather], model=model_cls(model="smollm2", openai_client=client),
                             # required on the first turn: a 135M model under auto may answer from
                             # memory; the SDK resets the choice to auto once the tool ran
                             # (Agent.reset_tool_choice), so the second turn can answer
                             model_settings=agents.ModelSettings(max_tokens=120, temperature=0.2,
                                                                 tool_choice="required"))
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=6)

    result = asyncio.run(go())
    assert calls and isinstance(result.final_output, str) and result.final_output


def test_the_log_of_all_of_it_replays_identical(server, clients):
    """Last in the file: it stops the shared server to close its log."""
    oa, _ = clients
    oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=8,
                               response_format={"type": "json_object"})
    server.stop()
    out = subprocess.run([sys.executable, "-m", "imp", "replay", str(server.event_log)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].endswith("identical"), out.stdout + out.stderr
