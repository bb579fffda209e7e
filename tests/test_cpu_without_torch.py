"""The default CPU server never loads torch (issue 15 §4: `import torch` alone is ~185 MB of RSS).

The real server on the real SmolLM2 file answers a greedy request, a seeded sampled one with
logprobs, a penalized one and a schema-constrained one, prompt logprobs included; then no
libtorch is mapped into its process."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_cpu_server_serves_every_sampler_path_without_torch(smollm2_path, tmp_path):
    from tests.serverproc import ServerProcess

    msgs = [{"role": "user", "content": "Name a colour."}]
    with ServerProcess(smollm2_path, "--kv-cache-tokens", "4096", log_path=tmp_path / "s.out") as srv:
        greedy = _post(srv.url, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 8,
                                                         "temperature": 0})
        seeded = [_post(srv.url, "/v1/chat/completions",
                        {"model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0.9, "top_p": 0.9,
                         "top_k": 40, "min_p": 0.05, "seed": 11, "logprobs": True, "top_logprobs": 3})
                  for _ in range(2)]
        penalized = _post(srv.url, "/v1/chat/completions",
                          {"model": "m", "messages": msgs, "max_tokens": 8, "frequency_penalty": 1.0,
                           "presence_penalty": 0.5, "logit_bias": {"42": 5}})
        schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
                  "required": ["colour"], "additionalProperties": False}
        constrained = _post(srv.url, "/v1/chat/completions",
                            {"model": "m", "messages": msgs, "max_tokens": 40,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
        scored = _post(srv.url, "/v1/completions", {"model": "m", "prompt": "The sky is", "max_tokens": 2,
                                                    "prompt_logprobs": 2})
        maps = Path(f"/proc/{srv.model_pid}/maps").read_text()

    assert greedy["choices"][0]["message"]["content"]
    a, b = (s["choices"][0] for s in seeded)
    assert a["message"]["content"] == b["message"]["content"]  # the seed fixes the draw
    tops = a["logprobs"]["content"][0]["top_logprobs"]
    assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    assert penalized["choices"][0]["finish_reason"] in ("length", "stop")
    assert set(json.loads(constrained["choices"][0]["message"]["content"])) == {"colour"}
    plp = scored["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and all(p for p in plp[1:])
    assert "libtorch" not in maps, "the CPU server mapped libtorch"


def test_api_server_processes_hold_no_torch(smollm2_path, tmp_path):
    """Under --api-servers 2 neither the engine nor an API-server process (tokenizer, templates,
    grammars, SSE) maps libtorch: each would carry ~180 MB for nothing."""
    from tests.serverproc import ServerProcess

    with ServerProcess(smollm2_path, "--kv-cache-tokens", "2048", "--api-servers", "2",
                       log_path=tmp_path / "p.out") as srv:
        out = _post(srv.url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 8, "response_format": {"type": "json_object"}})
        procs = _tree(srv.proc.pid)
        maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in procs}
    assert out["choices"][0]["message"]["content"].lstrip().startswith("{")
    assert len(maps) >= 4, maps.keys()  # supervisor, engine, two API servers
    assert not [pid for pid, m in maps.items() if "libtorch" in m]


def _tree(root: int) -> list[int]:
    """root and every process below it (from /proc/PID/stat's parent field)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out
