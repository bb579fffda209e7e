"""A dialect added as an exercise: a parser and a renderer, one route line, the shared pipeline."""

from aiohttp.test_utils import TestClient, TestServer

from imp.config import ServerConfig
from imp.http.app import create_app
from imp.http.pipeline import fields
from imp.http.pipeline.dialect import Base
from imp.http.pipeline.request import GenerateRequest, Message, Sampling
from imp.http.pipeline.run import handler
from tests.fake_engine import FakeEngine


class Toy(Base):  # {"say": text, "limit": N, "stream": bool} -> {"heard": text, "tokens": N}
    endpoint, id_prefix, fields = "toy", "toy-", frozenset({"say", "limit", "stream"})

    async def parse(self, body, ctx):
        return GenerateRequest(endpoint="toy", messages=(Message(role="user", content=fields.string(
            body, "say", required=True)),), max_tokens=fields.num(body, "limit", 1, integer=True),
            stream=fields.boolean(body, "stream"), sampling=Sampling(temperature=0.0)), None

    def renderer(self, job):
        return ToyOut()


class ToyOut:  # one JSON object; SSE: a line a delta, then the count
    thinking, text, n = False, "", 0

    def take(self, d): self.text, self.n = self.text + d.text, d.completion_tokens  # noqa: E704
    async def body(self): return {"heard": self.text, "tokens": self.n}  # noqa: E704
    def start(self, first): return b""  # noqa: E704
    def keepalive(self): return b": .\n\n"  # noqa: E704
    def delta(self, d): self.take(d); return f"data: {d.text}\n\n".encode() if d.text else b""  # noqa: E702,E704
    async def end(self): return f"data: [{self.n} tokens]\n\n".encode()  # noqa: E704
    def error(self, message, code): return f"data: error {code}\n\n".encode()  # noqa: E704


async def test_a_toy_dialect_runs_through_the_pipeline():
    eng = FakeEngine()
    app = create_app(eng, eng.tm, ServerConfig())
    app.router.add_route("POST", "/toy", handler(Toy()))
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/toy", json={"say": "hi", "limit": 64})
        got = await r.json()
        assert r.status == 200 and got["heard"] == "Hello world!" and got["tokens"] >= 3
        r = await c.post("/toy", json={"say": "hi", "stream": True})
        events = (await r.text()).split("\n\n")
        assert events[:3] == ["data: Hello", "data:  world", "data: !"] and events[3].endswith(" tokens]")
        r = await c.post("/toy", json={"limit": 0})
        assert r.status == 400 and (await r.json())["error"]["param"] == "say"
    sub = eng.submissions[0]  # what the pipeline resolved: the budget, the sampling, the prompt
    assert sub.params.max_tokens == 64 and sub.params.temperature == 0.0 and len(sub.prompt) > 2
    assert [r.endpoint for r in eng.reports] == ["toy", "toy"]
