"""A request's life in the scheduler, from Enqueue to Finished: its sequences' states (`_set`,
the one place they change), the tokens a step sampled and the finish decision they bring
(EOS / stop token, max_tokens, context end), cancels, timeouts, end_thinking, preemption,
and the prompt pins of cache_prompt and sessions, and banned phrases' rewinds. `SchedulerCore`
(imp.core.scheduler) is this book plus the step.

Banned strings / regexes (params.banned; the text watch is imp.core.banned): a token that completes
a phrase rewinds the sequence to the generated token the phrase starts in, bans that token at that
index (the next share that samples there carries it: SeqWork.banned) and recomputes from there as a
preempted sequence does (its blocks freed, so a full block of the old text stays a valid cache entry
and the kept text's blocks come back as cache hits; nothing cached is ever written over). Tokens a
phrase may still reach are held back, so a banned phrase never reaches the client.

n > 1: sibling i is f"{req_id}#{i}" with seed + i. The siblings wait (HELD)
until the first has computed the prompt, then fork its full prompt blocks.
Cancels, timeouts and executor faults end a request at once; tokens of a step
in flight for it are dropped, its blocks are freed in the next KvRequest.
"""

from __future__ import annotations

from bisect import insort

import msgspec

from imp.core.banned import BanWatch, Texts
from imp.core.core import CoreError, Out
from imp.core.schedstate import Req, SchedulerConfig, Seq, Status
from imp.messages import (Enqueue, Finished, FinishReason, KvOp, Reject, SampledToken, SamplingParams, TokenOut,
                          TokenTexts)


class RequestBook:
    """The requests and sequences of one scheduler, and every change of their state."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.max_len = min(config.max_context, config.num_blocks * config.block_size)
        self.requests: dict[str, Req] = {}
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.frees: list[KvOp] = []  # for the next KvRequest (frees, pins, unpins)
        self.sessions: dict[str, int] = {}  # session id -> last use (ns), oldest first
        self.now = 0
        self.preemptions = self.cancellations = self.timeouts = self.steps = self.rewinds = 0
        self.swap_used = 0  # swap slots parked sequences hold (the allocator keeps which)
        self.texts: Texts | None = None  # the vocabulary's text, for banned phrases (a TokenTexts)
        self._orders = self._admits = 0
        self._reserved_running = 0  # sum of reserved over requests with a running sequence (kept by _set)
        self.lane = None  # the scheduler's decode lane (imp.core.lane), when its config has one

    def _wkey(self, s: Seq) -> tuple:
        """The waiting list's order (kept sorted by it): the part of the admission order (`SchedulerCore._key`)
        that does not move with the clock, and the arrival's remainder v that says which part does
        (`SchedulerCore._waiting_order`)."""
        k = s.wkey
        if k is None:
            r = s.req
            u, v = divmod(r.arrival_ns * self.config.max_context, self.config.aging_ns)
            k = s.wkey = (r.priority, len(r.prompt) + u, r.order, s.index, v)
        return k

    def _own(self, s: Seq) -> None:
        """Before anything but the lane touches a sequence's counters: out of the lane (imp.core.lane)."""
        if s.lane >= 0:
            self.lane.eject(s)

    def _enqueue(self, e: Enqueue, out: Out) -> None:
        m = e.submit
        if m.req_id in self.requests:
            raise CoreError(f"duplicate request {m.req_id}")
        if not 0 < len(m.prompt) < self.max_len:  # admission checks this; never trust a neighbour
            out.append(("ingress", Reject(m.req_id, 400, "context_length_exceeded",
                                          f"prompt of {len(m.prompt)} tokens does not fit")))
            out.append(("admission", Finished(m.req_id, FinishReason.REJECTED)))
            return
        self._orders += 1
        r = self.requests[m.req_id] = Req(m, self._orders, min(e.reserved_blocks, self.config.num_blocks))
        if m.params.banned and self.texts is None:
            raise CoreError(f"{m.req_id} has banned phrases but no TokenTexts came before it")
        for i in range(m.n):
            p = m.params if i == 0 else msgspec.structs.replace(m.params, seed=(m.params.seed + i) % (1 << 63))
            r.seqs.append(Seq(r, i, p))
            if p.banned:
                r.seqs[-1].watch = BanWatch(self.texts, p.banned_strings, p.banned_regex)
            if p.cfg_scale != 1.0 and m.cfg_prompt:  # its shadow (imp.core.guide): a plain greedy row, never drawn
                s = r.seqs[-1]
                s.shadow = Seq(r, i, SamplingParams(max_tokens=p.max_tokens, stop_token_ids=p.stop_token_ids,
                                                    lora=p.lora), prompt=m.cfg_prompt, guided=s)
        self._set(r.seqs[0], Status.WAITING)
        if r.seqs[0].shadow is not None:
            self._set(r.seqs[0].shadow, Status.WAITING)

    def _texts(self, m: TokenTexts) -> None:
        self.texts = Texts(m.blob, m.offsets)

    def _sampled(self, s: Seq, t: SampledToken, out: Out) -> None:
        """The token(s) a step sampled for the sequence: a verify's kept drafts, then `t`; the first
        that finishes the choice ends it, and what follows it is dropped."""
        p, r = s.params, s.req
        if t.accepted or s.watch is not None:
            ts = (*t.accepted, msgspec.structs.replace(t, accepted=())) if t.accepted else (t,)
            if s.watch is not None:
                return self._sampled_watched(s, ts, out)
            reason = FinishReason.NONE
            for i, x in enumerate(ts):
                s.tokens.append(x.token_id)
                reason = self._ends(s, x.token_id)
                if reason:
                    ts = ts[:i + 1]
                    s.num_computed = min(s.num_computed, len(s.tokens))  # past a dropped draft token: not its KV
                    break
            ids = [x.token_id for x in ts]
        else:  # one token (most rows of most steps): the loop above without its tuples
            ts, ids = (t,), (t.token_id,)
            s.tokens.append(t.token_id)
            reason = self._ends(s, t.token_id)
            if reason:
                s.num_computed = min(s.num_computed, len(s.tokens))
        if s.shadow is not None:  # the shadow decodes the choice's tokens
            s.shadow.tokens.extend(ids)
        if ts[-1].mu is not None:  # mirostat's state after the last token kept (a re-admission resumes it)
            s.mu = ts[-1].mu
        tout = self._token_out(s, ids, reason, ts if p.logprobs >= 0 else ())
        if p.prompt_logprobs >= 0 and s.index == 0 and not s.plp_sent:
            tout = msgspec.structs.replace(tout, prompt_logprobs=tuple(s.plp))
            s.plp, s.plp_sent = [], True
        out.append(("detok", tout))
        if s.index == 0 and len(r.seqs) > 1:  # the prompt is computed: the siblings may fork it
            self._release_siblings(r)
        if reason:
            self._finish(s, reason, out)

    def _ends(self, s: Seq, token: int) -> FinishReason:
        """Whether the token just appended to s ends its choice: EOS / a stop token (a grammar ends at EOS even
        with ignore_eos), max_tokens, the context (a guided choice's shadow's too)."""
        p = s.params
        if token in p.stop_token_ids and (not p.ignore_eos or p.constrained):
            return FinishReason.STOP
        if len(s.tokens) - len(s.req.prompt) >= p.max_tokens or len(s.tokens) >= self.max_len or (
                s.shadow is not None and len(s.shadow.tokens) + 1 >= self.max_len):
            return FinishReason.LENGTH
        return FinishReason.NONE

    def _sampled_watched(self, s: Seq, ts: tuple[SampledToken, ...], out: Out) -> None:
        """`_sampled` for a sequence with banned phrases: each token through the watch first; one that
        completes a phrase rewinds (and drops what follows it); what no phrase can reach any more goes out."""
        p, r, w = s.params, s.req, s.watch
        reason = FinishReason.NONE
        for x in ts:
            s.tokens.append(x.token_id)
            if p.logprobs >= 0:
                s.held_lp.append(x)
            at = w.push(x.token_id)
            if at is not None:  # a phrase completed: never past what went out (a regex's reach is unbounded)
                self._rewind(s, max(at, s.emitted))
                if s.index == 0 and len(r.seqs) > 1:
                    self._release_siblings(r)
                return
            reason = self._ends(s, x.token_id)
            if reason:
                break
        if s.index == 0 and len(r.seqs) > 1:
            self._release_siblings(r)
        if reason:
            self._flush(s, reason, out)
            self._finish(s, reason, out)
        else:
            self._flush(s, reason, out, upto=w.safe())

    def _flush(self, s: Seq, reason: FinishReason, out: Out, upto: int | None = None, error: str = "",
               extra: tuple[int, ...] = ()) -> None:
        """Send a watched sequence's held tokens up to generated index `upto` (None: all), then `extra`."""
        n_prompt, gen = len(s.req.prompt), len(s.tokens) - len(s.req.prompt) - len(extra)
        upto = gen if upto is None else min(upto, gen)
        ids = tuple(s.tokens[n_prompt + s.emitted:n_prompt + upto]) + extra
        if not ids and not reason:
            return
        lp, s.held_lp = s.held_lp[:upto - s.emitted], s.held_lp[upto - s.emitted:]
        s.emitted = max(s.emitted, upto) + len(extra)
        out.append(("detok", self._token_out(s, ids, reason, lp if s.params.logprobs >= 0 else [], error)))

    def _rewind(self, s: Seq, keep: int) -> None:
        """Back to the first `keep` generated tokens; the next one (where the phrase started) banned there.
        Recomputed as after a preemption: its blocks are freed (hashed as written first) and it waits."""
        n_prompt = len(s.req.prompt)
        banned = s.tokens[n_prompt + keep]
        s.watch.rewind(keep)
        s.bans = {g: b for g, b in s.bans.items() if g < keep}  # later indices had another context
        s.bans[keep] = s.bans.get(keep, ()) + (banned,)
        self._drop_kv(s)
        s.num_computed = s.num_reported = 0
        del s.tokens[n_prompt + keep:]
        del s.held_lp[keep - s.emitted:]
        self._set(s, Status.WAITING)
        self.rewinds += 1

    def _end(self, r: Req, reason: FinishReason, out: Out, error: str = "", index: int = -1) -> None:
        """End the request's unfinished choices (index: just that one)."""
        for s in r.seqs:
            if s.status is not Status.FINISHED and index in (-1, s.index):
                if s.watch is not None:  # what it held goes with its end (no phrase is complete in it)
                    self._flush(s, reason, out, error=error)
                else:
                    out.append(("detok", self._token_out(s, [], reason, [], error)))
                self._finish(s, reason, out)

    def _end_thinking(self, r: Req, ids: list[int], out: Out) -> None:
        """Force `ids` (the model's </think>) into every unfinished choice.

        They join the generated tokens: the next step feeds them (a short
        prefill), and a token sampled by a step in flight now is dropped,
        because it was drawn before them. A choice without room for them
        and one more token keeps thinking to its end.
        """
        for s in r.seqs:
            if s.status is Status.FINISHED or not ids or len(s.tokens) + len(ids) >= self.max_len:
                continue
            self._own(s)
            s.epoch, s.ahead, s.pending = s.epoch + 1, 0, 0  # work in flight fed the old context
            s.tokens.extend(ids)
            if s.shadow is not None:
                g = s.shadow
                g.epoch, g.ahead, g.pending = g.epoch + 1, 0, 0
                g.tokens.extend(ids)
            s.send_params = True  # the executor's kept history has a dropped token and lacks ids: send it anew
            if s.watch is not None:  # forced text is the client's, not the model's: out with what was held
                for x in ids:
                    s.watch.push(x)
                self._flush(s, FinishReason.NONE, out, extra=tuple(ids))
                continue
            out.append(("detok", self._token_out(s, tuple(ids), FinishReason.NONE, ())))

    def _finish(self, s: Seq, reason: FinishReason, out: Out) -> None:
        self._own(s)
        self._drop_kv(s)
        self._set(s, Status.FINISHED)
        g = s.shadow
        if g is not None and g.status is not Status.FINISHED:  # its shadow ends with it
            self._drop_kv(g)
            self._set(g, Status.FINISHED)
        if s.index == 0:  # ended before its first token (a cancel of choice 0): don't strand them
            self._release_siblings(s.req)
        if s.req.n_live == 0:
            r = s.req
            del self.requests[r.id]
            if r.pin_key and reason is not FinishReason.ERROR:  # after the frees: blocks are hashed
                self.frees.append(KvOp("pin", r.pin_key, token_ids=tuple(r.prompt[:r.pin_len]), salt=r.salt))
                if r.session_id:
                    self.sessions.pop(r.session_id, None)
                    self.sessions[r.session_id] = self.now
            out.append(("admission", Finished(r.id, reason)))

    def _close_session(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.frees.append(KvOp("unpin", f"session:{sid}"))

    def _release_siblings(self, r: Req) -> None:
        for sib in r.seqs[1:]:
            if sib.status is Status.HELD:
                self._set(sib, Status.WAITING)
                if sib.shadow is not None:
                    self._set(sib.shadow, Status.WAITING)

    def _advance(self, now_ns: int, out: Out) -> None:
        self.now = max(self.now, now_ns)
        ttl = self.config.session_ttl_ns
        while self.sessions:  # oldest use first: stop at the first one still alive
            sid, last = next(iter(self.sessions.items()))
            if self.now - last < ttl:
                break
            self._close_session(sid)
        t = self.config.request_timeout_ns
        if t:
            for r in [r for r in self.requests.values() if self.now - r.arrival_ns >= t]:
                self.timeouts += 1
                self._end(r, FinishReason.TIMEOUT, out)

    def _set(self, s: Seq, new: Status) -> None:
        """The one place a sequence changes state (and the lists follow)."""
        self._own(s)
        if s.status is Status.WAITING:
            self.waiting.remove(s)
        elif s.status is Status.RUNNING:
            s.epoch, s.ahead, s.pending = s.epoch + 1, 0, 0  # its steps in flight no longer count
            self.running.remove(s)
            s.req.n_running -= 1
            if s.req.n_running == 0:
                self._reserved_running -= s.req.reserved
        s.status = new
        if new is Status.WAITING:
            insort(self.waiting, s, key=self._wkey)
        elif new is Status.RUNNING:
            self.running.append(s)
            s.req.n_running += 1
            if s.req.n_running == 1:
                self._reserved_running += s.req.reserved
            self._admits += 1
            s.admit_no = self._admits
        elif new is Status.FINISHED and s.guided is None:  # a shadow is not a choice
            s.req.n_live -= 1
        assert len(self.running) <= self.config.max_batch_size

    def _preempt_for(self, failed: list[Seq]) -> None:
        """For each sequence whose decode could not grow (and still runs), preempt the worst
        running one (highest priority number, then newest): its blocks freed, it waits again
        and is recomputed later, prompt plus generated tokens."""
        # Each preemption frees at least the victim's last block, which is never shared: enough for one decode to
        # grow next step. A failed sequence that is its own victim needs none, so its block is spare for the next
        # failed one: two sequences that filled the pool and both failed to grow once preempted each other (the
        # worse one itself, then the other for want of a block it already had), were admitted together again and
        # failed again, for ever (tests/test_scheduler_core.py's machine found it)
        spare = 0
        for s in failed:
            if s.status is Status.RUNNING:
                if spare:
                    spare -= 1
                    continue
                victim = max(self.running, key=lambda v: (v.req.priority, v.admit_no))
                spare += victim is s
                self._own(victim)
                if self._swaps(victim):
                    self._swap_out(victim)
                    continue
                self._preempt(victim)
                partner = victim.shadow or victim.guided  # a guided pair waits together (imp.core.guide):
                if partner is not None and partner.status is Status.RUNNING:  # one alone holds blocks for naught
                    self._preempt(partner)

    def _preempt(self, victim: Seq) -> None:
        self._own(victim)
        self._free(victim)
        victim.num_computed = victim.num_reported = 0
        self._set(victim, Status.WAITING)
        self.preemptions += 1

    def _swaps(self, v: Seq) -> bool:
        """The cost model: park the victim's KV (its blocks out now and back later) rather than compute its
        positions again, when there is room in the swap area and the copies cost less. A guided pair's halves
        are preempted by other paths too (imp.core.guide): they recompute."""
        c, kept = self.config, min(v.num_computed, len(v.tokens) - 1)
        n = -(-kept // c.block_size)
        return (kept > 0 and v.shadow is None and v.guided is None and self.swap_used + n <= c.swap_blocks
                and n * c.swap_ns_per_block < kept * c.recompute_ns_per_token)

    def _swap_out(self, victim: Seq) -> None:
        self._own(victim)
        kept = min(victim.num_computed, len(victim.tokens) - 1)
        self.frees.append(KvOp("swap_out", victim.id, kept, tuple(victim.tokens[victim.num_reported:kept])))
        victim.in_kv, victim.table = False, ()
        victim.swapped = kept
        self.swap_used += -(-kept // self.config.block_size)
        victim.num_computed = victim.num_reported = 0
        self._set(victim, Status.WAITING)
        self.preemptions += 1

    def _swapped_in(self, s: Seq) -> None:
        """Its swap_in landed (or it ended): the slots are the allocator's again."""
        self.swap_used -= -(-s.swapped // self.config.block_size)
        s.swapped = 0

    def _drop_kv(self, s: Seq) -> None:
        """Whatever KV the sequence holds goes: its blocks, or its parked swap slots."""
        if s.in_kv:
            self._free(s)
        elif s.swapped:
            self.frees.append(KvOp("unswap", s.id))
            self._swapped_in(s)

    def _free(self, s: Seq) -> None:
        self.frees.append(KvOp("free", s.id, token_ids=tuple(s.tokens[s.num_reported:s.num_computed])))
        s.in_kv, s.table = False, ()

    def _reserved(self) -> int:
        # kept incrementally: summing over every request was a tenth of a step at batch 256
        return self._reserved_running

    def _token_out(self, s: Seq, ids, reason: FinishReason, lp, error: str = "") -> TokenOut:
        """Every TokenOut carries the speculation counters of the verifies since the choice's one before, and
        a choice's first one a speculation decline (when there is one) as its last one does, so that a choice
        a stop string ends (the renderer ends it, not the scheduler) still reports them. (Its cache hit is on
        the last one only: a first TokenOut carrying it would change every captured log's outputs.)"""
        ids, lp = tuple(ids), tuple(lp)
        sd, sa, sv = s.spec_drafted, s.spec_accepted, s.spec_verifies
        s.spec_drafted = s.spec_accepted = s.spec_verifies = 0
        first, s.opened = not s.opened, True
        if not reason:
            declined = self._declined(s.params) if first else ""
            if not sv and not declined:
                return TokenOut(s.req.id, s.index, ids, logprobs=lp)
            return TokenOut(s.req.id, s.index, ids, logprobs=lp, spec_drafted=sd, spec_accepted=sa,
                            spec_verify_steps=sv, spec_declined=declined)
        return TokenOut(s.req.id, s.index, ids, reason, len(s.req.prompt), max(0, s.req.cached_tokens),
                        len(s.tokens) - len(s.req.prompt), lp, error, spec_drafted=sd, spec_accepted=sa,
                        spec_verify_steps=sv, spec_declined=self._declined(s.params),
                        banned_rewinds=s.watch.rewinds if s.watch is not None else 0)

    def _declined(self, p) -> str:
        """Why speculation the request asked for did not run ("" = it did, or none was asked)."""
        if p.mtp_k > 0:
            return "no_mtp_head"
        if p.speculative and not self.config.spec_k_max:
            return "executor_cannot_verify"
        if p.speculative and not p.drafts:  # a rewind would cut the drafter's text; the lens wants each token
            return "banned_phrases" if p.banned else "logit_lens"
        return ""

