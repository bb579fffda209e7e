"""Constrained decode throughput as a ratio to unconstrained, at batch 1 and 32.

    python bench/constrained_decode.py --model PATH [--device cpu|cuda:0] [--steps 64]

B sequences of one prompt decode `steps` greedy tokens through the runner the
executor drives (CPU ModelRunner or GpuModelRunner), once unconstrained and once
with a grammar on every row (json_object; a json_schema), the mask computed by the
executor's ConstraintBook from each row's history and applied before sampling, as
in serving. Prints tok/s for each and the ratio (1.0 = a grammar costs nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from imp.constrain.book import ConstraintBook  # noqa: E402
from imp.constrain.compile import GrammarCache  # noqa: E402
from imp.constrain.vocab import from_tokenizer  # noqa: E402
from imp.messages import Constraint, SamplingParams, SeqWork  # noqa: E402
from imp.text.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "age": {"type": "integer"}}, "required": ["name", "tags", "age"]}


def load(path: str, device: str, blocks: int, bs: int):
    if device.startswith("cuda"):
        from imp.gpu.runner import GpuModelRunner

        return GpuModelRunner.load(path, num_blocks=blocks, block_size=bs, device=device, max_graph_batch=32)
    from imp.model.runner import ModelRunner

    return ModelRunner.load(path, num_blocks=blocks, block_size=bs)


def run(runner, book, B: int, steps: int, prompt: list[int], constraint: Constraint | None, bs: int) -> float:
    """tok/s of `steps` decode steps of B rows (after their prefill, not timed)."""
    per = (len(prompt) + steps + bs) // bs + 1
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(B)]
    params = SamplingParams(max_tokens=steps + 1, constraint=constraint, stop_token_ids=())
    ids = [f"s{i}" for i in range(B)]
    out: list[list[int]] = [[] for _ in range(B)]
    works = [SeqWork(ids[i], tuple(prompt), 0, tables[i], True, params) for i in range(B)]
    for i, t in enumerate(runner.step(works, constraints=book)):
        out[i].append(t.token_id)
    t0 = time.perf_counter()
    for k in range(steps):
        works = [SeqWork(ids[i], (out[i][-1],), len(prompt) + k, tables[i], True, params, gen_index=k + 1,
                         history=tuple(out[i]) if constraint is not None else ()) for i in range(B)]
        for i, t in enumerate(runner.step(works, constraints=book)):
            out[i].append(t.token_id)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    book.forget(ids)
    return B * steps / dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    a = ap.parse_args()
    bs = 16
    tok = Tokenizer.from_gguf(a.model)
    runner = load(a.model, a.device, 32 * 16 + 64, bs)
    book = ConstraintBook(GrammarCache(from_tokenizer(tok, int(runner.config.vocab_size))))
    prompt = tok.encode("Describe a person as JSON: ")
    specs = {"json_object": Constraint("json_object"), "json_schema": Constraint("json_schema", json.dumps(SCHEMA))}
    for c in specs.values():
        book.cache.compile_sync(c, 10.0)
    print("| device | batch | unconstrained tok/s | grammar | constrained tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for B in (int(x) for x in a.batches.split(",")):
            run(runner, book, B, 4, prompt, None, bs)  # warm-up (graphs, JIT)
            base = run(runner, book, B, a.steps, prompt, None, bs)
            for name, c in specs.items():
                run(runner, book, B, 4, prompt, c, bs)
                got = run(runner, book, B, a.steps, prompt, c, bs)
                print(f"| {a.device} | {B} | {base:,.0f} | {name} | {got:,.0f} | {got / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
