"""The decision cores, built from boot facts (replay rebuilds them from the log header)."""

from __future__ import annotations

from imp.config import ServerConfig, itl_policy_on, itl_ratio, pipeline_depth, step_tokens
from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.core.kv import KvConfig, KvCore
from imp.core.replicas import Routed
from imp.core.scheduler import SchedulerConfig, SchedulerCore
from imp.engine.swap import SwapFacts


# New requests may bring this many times a step's token budget of prompt to one planning round: a prompt
# the prefix cache holds (an agent's next turn, a shared system prompt) costs the step only its uncached tail,
# which the KV reply reveals after planning; at 1x, 16 requests with a cached 354-token prompt took ~10 rounds
# to be admitted at the 512-token default (one and a half a round).
ADMIT_FACTOR = 8


def build_cores(cfg: ServerConfig, num_blocks: int, max_context: int, fingerprint: str, replicas: int = 1,
                verifies_drafts: bool = False, draft_max: int | None = None, tier_blocks: int = 0,
                swap: SwapFacts = SwapFacts(), tier_demote: bool = False,
                prompt_costs: tuple[tuple[int, int, int], ...] = (), prompt_ctx_ns: int = 0,
                prompt_ctx_by: tuple[tuple[int, int], ...] = (), verify_rows: int = 0):
    """admission, scheduler, kv (lists of `replicas` each when > 1, wrapped to talk to
    their own replica). Boot facts (pool size, context, fingerprint, whether the executor
    verifies drafts) go into each core's frozen config, and the configs into the event-log header."""
    kv = KvCore(KvConfig(num_blocks=num_blocks, block_size=cfg.block_size, fingerprint=fingerprint,
                         share_in_flight=True, tier_blocks=tier_blocks, swap_blocks=swap.blocks,
                         tier_demote=tier_demote))
    adm = AdmissionCore(
        AdmissionConfig(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            max_context=max_context,
            max_queued_tokens=cfg.max_queued_tokens,
            replicas=replicas,
        )
    )
    if replicas > 1:
        pairs = [build_cores(cfg, num_blocks, max_context, fingerprint, verifies_drafts=verifies_drafts,
                             draft_max=draft_max, tier_blocks=tier_blocks, swap=swap,
                             tier_demote=tier_demote, prompt_costs=prompt_costs,
                             prompt_ctx_ns=prompt_ctx_ns, prompt_ctx_by=prompt_ctx_by,
                             verify_rows=verify_rows)[1:] for _ in range(replicas)]
        return adm, [Routed(s, i) for i, (s, _) in enumerate(pairs)], [Routed(k, i) for i, (_, k) in enumerate(pairs)]
    sch = SchedulerCore(
        SchedulerConfig(
            block_size=cfg.block_size,
            num_blocks=num_blocks,
            max_batch_size=cfg.max_batch_size,
            max_step_tokens=step_tokens(cfg),
            admit_tokens=ADMIT_FACTOR * step_tokens(cfg),
            history_once=True,
            request_timeout_ns=int(cfg.request_timeout_s * 1e9),
            max_context=max_context,
            pipeline_depth=pipeline_depth(cfg),
            itl_target_ns=int(cfg.itl_target_ms * 1e6),
            itl_ratio=itl_ratio(cfg),
            spec_k_max=(cfg.spec_draft_max if draft_max is None else draft_max) if verifies_drafts else 0,
            spec_min_kept=1.0 if pipeline_depth(cfg) == 2 else 0.0,  # a verify costs its sequence a step there
            spec_max_rows=verify_rows if verifies_drafts else 0,  # the executor's largest decode graph (a GPU)
            swap_blocks=swap.blocks,
            swap_ns_per_block=swap.ns_per_block,
            recompute_ns_per_token=swap.recompute_ns_per_token,
            # the mixed graphs' measured bucket costs, for the ITL policy (only where one is on)
            prompt_step_ns=prompt_costs if itl_policy_on(cfg) else (),
            prompt_ctx_ns=prompt_ctx_ns if itl_policy_on(cfg) and prompt_costs else 0,
            prompt_ctx_by=prompt_ctx_by if itl_policy_on(cfg) and prompt_costs else (),
            decode_lane=True,
        )
    )
    return adm, sch, kv
