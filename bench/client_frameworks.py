"""What third-party frameworks send: run each against a server started with --strict-fields.

Under --strict-fields any body field the server does not take is a 400, so a framework that
completes here sends nothing this server would report or refuse by mistake. Runs what is
installed (the OpenAI Agents SDK, LangChain's ChatOpenAI, instructor, pydantic-ai, LiteLLM):
a plain chat, a streamed chat, a tool call and a structured output each, and prints a table.
The packages are not in the project's extras (they are large); install them beside it:

    pip install --target /tmp/clients langchain-openai instructor "pydantic-ai-slim[openai]" litellm
    python -m imp --model smollm2-135m --port 8099 --strict-fields &
    PYTHONPATH=/tmp/clients python bench/client_frameworks.py --url http://127.0.0.1:8099
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import traceback


def _have(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


def langchain(url: str) -> list[tuple[str, str]]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model="m", max_tokens=24, temperature=0)
    out = [("invoke", llm.invoke("Say hi.").content[:40])]
    out.append(("stream", "".join(c.content for c in llm.stream("Say hi."))[:40]))

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    out.append(("bind_tools", str(msg.tool_calls)[:60]))

    class City(BaseModel):
        name: str
        country: str

    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(City, method=method).invoke("Paris is in which country? Answer as a City.")
        out.append((f"structured ({method})", repr(got)[:60]))
    return out


def instructor_(url: str) -> list[tuple[str, str]]:
    import instructor
    import openai
    from instructor.core import IncompleteOutputException, InstructorRetryException
    from pydantic import BaseModel

    class User(BaseModel):
        name: str
        age: int

    out = []
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON):
        client = instructor.from_openai(openai.OpenAI(base_url=url + "/v1", api_key="none"), mode=mode)
        try:
            u = client.chat.completions.create(model="m", response_model=User, max_retries=1, max_tokens=256,
                                               messages=[{"role": "user", "content": "John is 30. Extract the user."}])
            out.append((f"response_model ({mode.value})", repr(u)[:60]))
        except (InstructorRetryException, IncompleteOutputException) as exc:  # the model's answer, not a refusal
            out.append((f"response_model ({mode.value})", f"the model's object did not validate: {str(exc)[:80]}"))
    return out


def pydantic_ai(url: str) -> list[tuple[str, str]]:
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=url + "/v1", api_key="none"))
    out = [("run_sync", str(Agent(model).run_sync("Say hi.", model_settings={"max_tokens": 24}).output)[:40])]

    class City(BaseModel):
        name: str
        country: str

    r = Agent(model, output_type=City).run_sync("Paris: give the City.", model_settings={"max_tokens": 64})
    out.append(("output_type", repr(r.output)[:60]))

    async def streamed() -> str:
        async with Agent(model).run_stream("Say hi.", model_settings={"max_tokens": 24}) as s:
            return "".join([t async for t in s.stream_text(delta=True)])
    out.append(("run_stream", asyncio.run(streamed())[:40]))
    return out


def litellm_(url: str) -> list[tuple[str, str]]:
    import litellm

    r = litellm.completion(model="openai/m", api_base=url + "/v1", api_key="none", max_tokens=24,
                           messages=[{"role": "user", "content": "Say hi."}])
    out = [("completion", r.choices[0].message.content[:40])]
    chunks = litellm.completion(model="openai/m", api_base=url + "/v1", api_key="none", max_tokens=24,
                                stream=True, stream_options={"include_usage": True},
                                messages=[{"role": "user", "content": "Say hi."}])
    out.append(("stream", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)[:40]))
    return out


def agents(url: str) -> list[tuple[str, str]]:
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    out = []
    for name, model in (("chat completions", OpenAIChatCompletionsModel("m", client)),
                        ("responses", OpenAIResponsesModel("m", client))):
        agent = Agent(name="a", instructions="Answer briefly.", model=model, tools=[get_weather])
        r = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)
        out.append((f"Runner.run_sync ({name})", str(r.final_output)[:40]))
    return out


CHECKS = {"agents": agents, "langchain_openai": langchain, "instructor": instructor_, "pydantic_ai": pydantic_ai, "litellm": litellm_}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8099")
    url = ap.parse_args().url
    print("| framework | call | result |\n|---|---|---|")
    for mod, fn in CHECKS.items():
        if not _have(mod):
            print(f"| {mod} | (not installed) | |")
            continue
        try:
            for call, result in fn(url):
                print(f"| {mod} | {call} | ok: {result!r} |".replace("\n", " "))
        except Exception as exc:  # noqa: BLE001 - the table says what failed, and how
            print(f"| {mod} | FAILED | {type(exc).__name__}: {str(exc)[:200]} |".replace("\n", " "))
            traceback.print_exc()


if __name__ == "__main__":
    main()
