"""One engine step: scheduler <-> kv, scheduler <-> executor, scheduler -> detok
(docs/STEP.md has the order).

    scheduler -KvRequest-> kv -KvReply-> scheduler           (the step's allocator ops)
    scheduler -StepPlan-> executor -StepResult-> scheduler   (or StepFailed)
    scheduler -TokenBatch-> detok                            (the TokenOuts of one decision)
"""

from __future__ import annotations

import array

from imp.messages.base import FinishReason, Msg, Struct
from imp.messages.params import SamplingParams


class PromptLogprob(Struct):
    """One prompt token scored by the raw model distribution (log-softmax of
    the logits at the position before it); position >= 1."""

    position: int
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()


class LensLayer(Struct):
    """The logit lens at one layer (params.logit_lens): the final norm and LM head on the residual after
    that layer, its raw distribution: the sampled token's rank (1 = the most likely) and logprob, the
    entropy in nats, and the top N (token id, logprob)."""

    rank: int
    logprob: float
    entropy: float
    top: tuple[tuple[int, float], ...] = ()


class SampledToken(Struct):
    seq_id: str
    token_id: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) when asked
    # prompt tokens scored this step (SeqWork.prompt_logprobs >= 0); token_id is -1
    # when the step sampled nothing for the sequence (a prefill chunk)
    prompt: tuple[PromptLogprob, ...] = ()
    # a verify share (SeqWork.draft > 0): the draft tokens it kept, in order, each as sampled at its
    # position; this token is sampled after the last of them (so a verify yields len(accepted) + 1)
    accepted: tuple[SampledToken, ...] = ()
    # mirostat: the sequence's mu after this draw (imp.sampling.mirostat); the scheduler keeps it for a
    # re-admission, so a preempted sequence goes on with the same state
    mu: float | None = None
    # the logit lens (params.logit_lens > 0): one entry per layer, first layer first
    lens: tuple[LensLayer, ...] = ()


class SeqWork(Struct):
    """One sequence's share of a step.

    token_ids are the tokens fed this step, at positions start_pos ...
    start_pos+len-1; block_table covers every position up to the last one.
    sample says whether the last position's logits are sampled (False for a
    prefill chunk that does not reach the end of the prompt).
    gen_index is the index of the token to be sampled among the generated
    ones; together with params.seed it fixes the random draw, so a
    recomputed (preempted) sequence draws the same tokens again.
    """

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    # sent with a sequence's first share after each (re)admission (alloc or fork), None
    # after that: the executor keeps them until the sequence is freed (half of a
    # batch-256 plan's bytes were repeated SamplingParams)
    params: SamplingParams | None
    gen_index: int = 0
    # generated tokens so far (params.needs_history: penalties, a grammar). With history_once the scheduler
    # sends every known one with the first share after each admission and () after that: the executor
    # (`attach_state`) fills a sampled share's history in from what it kept and sampled since
    history: tuple[int, ...] = ()
    # >= 0: score the prompt tokens at start_pos+1 .. (top k each), i.e. return
    # the raw logprob rows of this chunk's positions; prompt_next is the prompt
    # token after the chunk (-1 when the chunk ends the prompt)
    prompt_logprobs: int = -1
    prompt_next: int = -1
    # Pipelined steps (scheduler pipeline_depth > 1): the last `pending` tokens
    # of this sequence were sampled by earlier steps still in flight when the
    # scheduler planned this one, so it does not know them. A fed token of
    # PENDING_TOKEN stands for the one the previous step sampled for this
    # sequence, and `history` lacks those `pending` tokens: the executor
    # supplies both (on the device, or from the results it already has).
    pending: int = 0
    # Speculation (imp.core.spec): the last `draft` token_ids are a guess at what the sequence
    # samples next, fed after its last known token. The runner samples every one of the draft+1
    # positions as a decode step would (gen_index + j, the history with the draft's first j tokens)
    # and keeps the draft up to the first position whose sample differs (SampledToken.accepted).
    draft: int = 0
    # mirostat: the sequence's mu as the scheduler knows it, with the first share of an admission (None after
    # it: the runner's own); the runner keeps it from step to step (imp.sampling.mirostat.MirostatState)
    mu: float | None = None
    # banned phrases (imp.core.banned): tokens the sampled position may not take (the ones a rewind
    # found a banned phrase starting in there); the runner masks them -inf before anything samples
    banned: tuple[int, ...] = ()
    # classifier-free guidance: the seq_id of this share's shadow, whose share in the same step samples at the
    # same generated index; the runner samples this row from l_b + cfg_scale (l_a - l_b), l_b the shadow's
    guide: str = ""


PENDING_TOKEN = -1


class KvOp(Struct):
    """One allocator operation, as asked by the scheduler.

    kind = "alloc": a new sequence; token_ids is its full known token list
           (prompt, or prompt + generated when recomputing a preempted one);
           the allocator may reuse cached prefix blocks (never the block of
           the last token) and allocates blocks to hold num_tokens positions.
           KvResult.cached_tokens = the positions whose KV is already there.
    kind = "grow":  make the sequence's table hold num_tokens positions;
           token_ids are the tokens whose KV was written since the last op
           (for hashing newly full blocks into the prefix cache). They are
           recorded even when the grow itself fails.
    kind = "free":  release the sequence's blocks (full blocks stay cached);
           token_ids as for grow (hashed before the release).
    kind = "swap_out": a preempted sequence's KV of its first num_tokens positions parked in the swap
           area (KvSwapOut to the executor), then its blocks released as by "free" (token_ids
           as for free). Nothing is answered.
    kind = "swap_in": a swapped-out sequence back in the pool: a table for num_tokens positions,
           token_ids its known tokens; its parked positions come back from the swap area
           (KvSwapIn), leading full blocks still cached are shared instead of copied.
           cached_tokens = the parked positions. Fails for want of blocks as alloc does.
    kind = "unswap": a swapped-out sequence ended while parked: its swap slots are released.
    kind = "fork":  new sequence parent->seq_id (n > 1 siblings) holding
           num_tokens positions; token_ids its known tokens (the prompt). It
           shares the parent's full blocks of those positions, except the one
           of the last token (refcounts bumped), and gets its own tail blocks.
           cached_tokens = the shared positions.
    Once an op fails for want of blocks, every later op of the same
    KvRequest that needs a new block fails too (no queue jumping).
    """

    kind: str
    seq_id: str
    num_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    parent: str = ""
    salt: str = ""  # LoRA adapter name (prefix cache key)


class KvResult(Struct):
    seq_id: str
    ok: bool
    block_table: tuple[int, ...] = ()
    cached_tokens: int = 0  # alloc: prompt tokens found in the prefix cache
    wait: bool = False  # alloc refused (ok False) because another sequence is computing its next prompt block
    loading: bool = False  # ... or because its next blocks are on their way from the disk tier (KvReady follows)


class KvFigures(Struct):
    total: int
    free: int
    used: int
    reserved: int
    cached: int
    block_size: int
    evictions: int = 0
    pinned: int = 0  # blocks held by cache_prompt / session pins
    inflight_waits: int = 0  # allocs that waited for prompt blocks another sequence was computing (running total)
    # the disk tier (--prompt-cache-dir): blocks it holds now; blocks written to it, read back (asked), landed
    # as cache hits, found missing or corrupt, dropped for its size (running totals)
    tier_blocks: int = 0
    tier_saves: int = 0
    tier_loads: int = 0
    tier_hits: int = 0
    tier_misses: int = 0
    tier_drops: int = 0
    tier_host_hits: int = 0  # of tier_hits, those read from the host tier (--host-cache-gb), not from disk
    # the swap area (swap instead of recompute): its slots, those holding parked sequences' blocks now,
    # sequences parked and brought back (running totals)
    swap_blocks: int = 0
    swap_used: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    swap_copies: int = 0  # blocks copied to the swap area and back (running total)


class KvRequest(Msg):
    """scheduler -> kv: the allocator operations for one step, in order."""

    step: int
    ops: tuple[KvOp, ...]


class KvReply(Msg):
    """kv -> scheduler: one result per alloc/grow/fork op, in order."""

    step: int
    results: tuple[KvResult, ...]
    figures: KvFigures


class DecodeRows(Struct):
    """A step's decode lane rows (imp.core.lane) as columns: they come first in the step, in this order, before
    the plan's `seqs`. Each is a plain decode row: one token fed, one sampled, nothing else asked (no logprobs,
    drafts, lens, guidance, bans, prompt logprobs, params to send). Row r is sequence seq_ids[r]: it feeds token
    tokens[r] (PENDING_TOKEN: the one the step in flight samples for it) at position starts[r], its table
    tables[r] covering it, and samples its generated token number gens[r]; its params (and a penalized or
    constrained one's history) are the executor's, kept since the sequence's first share. As a SeqWork each row
    would be `SeqWork(seq_id, (token,), start, table, True, None, gen_index=gen, pending=token == PENDING_TOKEN)`
    (`imp.sampling.works.RowBatch.work`). Why columns: at 64-256 streams nearly every row of every step is one of
    these, and a Python object a row, made by the scheduler and copied by the executor, was the per-row cost
    issue 33's deliverable 3 takes out. cols is int64 [R, 3] (token, start, gen), little-endian bytes."""

    seq_ids: tuple[str, ...]
    tables: tuple[tuple[int, ...], ...]
    cols: bytes

    def __len__(self) -> int:
        return len(self.seq_ids)

    def works(self) -> list[SeqWork]:
        """The rows as the SeqWorks they stand for (params None: the executor's kept ones), one a row: for the
        tests' model stand-ins and the tools that read a plan, not for a hot path."""
        c = memoryview(self.cols).cast("q").tolist()
        return [SeqWork(sid, (c[3 * r],), c[3 * r + 1], tab, True, None, gen_index=c[3 * r + 2],
                        pending=int(c[3 * r] == PENDING_TOKEN))
                for r, (sid, tab) in enumerate(zip(self.seq_ids, self.tables))]


class StepPlan(Msg):
    """scheduler -> executor: run these sequences for one step (the lane's rows first, then seqs)."""

    step: int
    seqs: tuple[SeqWork, ...]
    freed: tuple[str, ...] = ()  # sequences the executor can forget
    rows: DecodeRows | None = None

    def shares(self) -> list[SeqWork]:
        """Every share of the step in its order, the rows as SeqWorks (`DecodeRows.works`)."""
        return self.rows.works() + list(self.seqs) if self.rows is not None else list(self.seqs)


class StepResult(Msg):
    """executor -> scheduler: what the step produced."""

    step: int
    tokens: tuple[SampledToken, ...]  # the plan's seqs' (not its rows')
    now_ns: int
    elapsed_ns: int = 0  # plan received -> tokens collected (pipelined: also the wait for the step before it)
    device_ns: int = 0  # the device's own time for the step where the runner times it (a GPU), else 0
    # the plan's DecodeRows' sampled ids, in row order, int64 little-endian bytes; -1 where a row did not run (its
    # sequence's pending token was not sampled: the step before failed, and the scheduler has ended it)
    row_ids: bytes = b""

    @property
    def cost_ns(self) -> int:
        """What the step cost: the device's time where measured, else the executor's wall."""
        return self.device_ns or self.elapsed_ns


def step_result(plan: StepPlan, tokens, now_ns: int, elapsed_ns: int = 0, device_ns: int = 0) -> StepResult:
    """A StepResult for `plan` from SampledTokens of any of its shares, the rows' ids put in their column (-1 for a
    row without one): how a model stand-in (tests, tools) answers a plan; the executor splits its own
    (`imp.sampling.works.split_tokens`)."""
    if plan.rows is None:
        return StepResult(plan.step, tuple(tokens), now_ns, elapsed_ns, device_ns)
    by = {t.seq_id: t for t in tokens}
    rows = set(plan.rows.seq_ids)
    ids = array.array("q", [by[s].token_id if s in by else -1 for s in plan.rows.seq_ids])
    return StepResult(plan.step, tuple(t for t in tokens if t.seq_id not in rows), now_ns, elapsed_ns, device_ns,
                      ids.tobytes())


class StepFailed(Msg):
    """executor -> scheduler: the step raised; its sequences end with ERROR."""

    step: int
    error: str
    now_ns: int


class TokenOut(Msg):
    """scheduler -> detok: new tokens of one choice of a request."""

    req_id: str
    index: int
    token_ids: tuple[int, ...]
    finish: FinishReason = FinishReason.NONE
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[SampledToken, ...] = ()
    error: str = ""
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # with the first token of choice 0
    # prompt_tokens, cached_tokens and completion_tokens on a choice's last TokenOut.
    # Speculation, on every TokenOut: draft tokens fed, kept, and verify shares run (each emitted its kept ones
    # + 1) since the choice's TokenOut before; declined (first and last): why a speculation asked for did not
    # run ("" = it did, or none asked)
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0
    spec_declined: str = ""
    banned_rewinds: int = 0  # banned phrases: the rewinds the choice took (on its last TokenOut)


class TokenRows(Msg):
    """Plain tokens of many choices as columns (scheduler -> detok -> ingress, and engine -> API server): choice
    `index` of request `req_id` got one more token, nothing else (no finish, logprobs, usage or counters: those
    go as TokenOuts). The decode lane's rows of a step travel as this one object instead of one TokenOut a row."""

    req_ids: tuple[str, ...]
    cols: bytes  # int64 [R, 2]: (choice index, token id) a row, in req_ids' order

    def rows(self) -> list[tuple[str, int, int]]:
        """(req_id, index, token id) a row."""
        flat = memoryview(self.cols).cast("q").tolist()
        return list(zip(self.req_ids, flat[0::2], flat[1::2]))

    def outs(self) -> list[TokenOut]:
        """The rows as the TokenOuts they stand for."""
        return [TokenOut(r, i, (t,)) for r, i, t in self.rows()]


def token_rows(rows: list[tuple[str, int, int]]) -> TokenRows:
    """(req_id, index, token id) a row, as columns."""
    flat = array.array("q")
    for _, i, t in rows:
        flat.append(i)
        flat.append(t)
    return TokenRows(tuple([r for r, _, _ in rows]), flat.tobytes())


class TokenBatch(Msg):
    """scheduler -> detok: every TokenOut of one scheduler decision, in order; the decode lane's plain tokens as
    columns (`rows`), delivered as if they stood at `outs[rows_at]` (a choice has at most one token a decision, so
    only the order among different choices can differ from one TokenOut a row's)."""

    outs: tuple[TokenOut, ...]
    rows: TokenRows | None = None
    rows_at: int = 0

    def each(self) -> list[TokenOut]:
        """Every TokenOut of the decision in delivery order, the rows as TokenOuts (tests and tools read this)."""
        if self.rows is None:
            return list(self.outs)
        return [*self.outs[:self.rows_at], *self.rows.outs(), *self.outs[self.rows_at:]]
