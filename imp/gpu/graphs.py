"""CUDA graphs for decode: one graph per batch bucket over static input buffers.

Decode steps (every share one token that samples) replay a captured graph of
the whole forward; the batch is padded up to the next bucket (1, 2, 4, ...).
All buckets share one memory pool, captured largest first.
"""

from __future__ import annotations

from typing import Callable

import torch

from imp.gpu.inputs import Meta, StaticInputs
from imp.gpu.linear import capture_stream
from imp.messages import SeqWork


class DecodeGraphs:
    def __init__(self, buckets: tuple[int, ...], max_blocks: int, block_size: int, device: torch.device):
        self.buckets = buckets
        self.max_blocks, self.block_size, self.device = max_blocks, block_size, device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.inputs: StaticInputs | None = None

    def capture(self, forward: Callable[[Meta], torch.Tensor]) -> None:
        """Warm every bucket up on a side stream (compiles kernels, settles tuned paths),
        then capture each, largest first, into one pool."""
        self.graphs.clear()
        self.inputs = inp = StaticInputs(max(self.buckets), self.max_blocks, self.block_size, self.device)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for b in self.buckets:
                forward(inp.meta(b))
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        pool = None
        for b in sorted(self.buckets, reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=capture_stream(self.device), capture_error_mode="thread_local"):
                out = forward(inp.meta(b))  # [b, vocab] fp32, a static output buffer
            pool = g.pool()
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(self.device)

    def fits(self, seqs: list[SeqWork], one: bool | None = None) -> bool:
        """A decode-only step small enough for a captured bucket. one: whether every share feeds one token,
        samples it and scores no prompt (the caller's columns), else read from the shares."""
        if not self.graphs or len(seqs) > max(self.graphs):
            return False
        if one is not None:
            return one
        return all(len(s.token_ids) == 1 and s.sample and s.prompt_logprobs < 0 for s in seqs)

    def replay(self, seqs: list[SeqWork], src: dict[int, int] | None = None, mark=None, cols=None) -> torch.Tensor:
        """logits [B, vocab] (a view of the graph's output: read before the next replay);
        src: share index -> previous-step slot for PENDING_TOKEN shares; mark(): called once the host's
        part is done, right before the step's first device work (GpuModelRunner.device_ns times from there)."""
        B = len(seqs)
        b = next(x for x in sorted(self.graphs) if x >= B)
        self.inputs.write(seqs, b, src, mark, cols)
        g, out = self.graphs[b]
        g.replay()
        return out[:B]
