"""Swap instead of recompute, the boot side: the swap area's size and the two costs the scheduler's cost
model compares (imp.core.lifecycle `_swaps`), measured once here and frozen into its config, which the
event log's header carries, so a replay decides every preemption alike without a clock.

    swap cost      = blocks x (one block out to the area and back in), timed on the runner's own copies
    recompute cost = positions x (one prompt token of a prefill), from the boot warm-up's prefill rate

--preemption-mode swap makes recompute look dear (every preemption swaps while the area has room),
recompute gives the scheduler no area (the policy before swap).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from imp.messages import KvSwapIn, KvSwapOut

log = logging.getLogger("imp.swap")

# when the boot warm-up did not run (it is the CPU's; a GPU boots without one): a prefill rate that errs
# towards recompute (below what the kernels measure on either executor: bench/gpu.py, bench/cpu_serving.py)
FALLBACK_PREFILL_TOK_S = {"cpu": 2_000.0, "cuda": 40_000.0}
ALWAYS = 10**15  # "swap": a recompute cost no copy reaches


class SwapFacts(NamedTuple):
    blocks: int = 0  # the area's slots (0: no swap)
    ns_per_block: int = 0
    recompute_ns_per_token: int = 0


def swap_facts(mode: str, space_gb: float, runner, device: str, prefill_tok_s: float | None) -> SwapFacts:
    """Make the runner's swap area and measure its copies; SwapFacts() where there is none."""
    if mode == "recompute" or space_gb <= 0 or not getattr(runner, "supports_swap", False):
        return SwapFacts()
    n = max(1, min(int(space_gb * 2**30) // runner.kv_block_bytes(), 1 << 24))
    runner.make_swap(n)
    ns = measure_copy_ns(runner, min(16, n, runner.num_blocks))
    rate = prefill_tok_s or FALLBACK_PREFILL_TOK_S["cpu" if device == "cpu" else "cuda"]
    per_token = ALWAYS if mode == "swap" else max(1, int(1e9 / rate))
    log.info("swap area: %d blocks (%.2f GB); a block out and in %.1f us, a prompt token %.1f us (%s)", n,
             n * runner.kv_block_bytes() / 2**30, ns / 1e3, 1e9 / rate / 1e3, mode)
    return SwapFacts(n, ns, per_token)


def measure_copy_ns(runner, k: int, reps: int = 3) -> int:
    """One block out to the swap area and back in (best of reps, per block). At boot nothing runs: the
    blocks it copies come back unchanged."""
    blocks, slots = tuple(range(k)), tuple(range(k))
    best = None
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        runner.swap_out(KvSwapOut(blocks, slots))
        runner.swap_in(KvSwapIn(slots, blocks))
        sync = getattr(runner, "synchronize", None)
        if sync is not None:
            sync()
        dt = time.perf_counter_ns() - t0
        best = dt if best is None else min(best, dt)
    return max(1, best // k)
