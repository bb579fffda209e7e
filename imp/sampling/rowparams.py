"""The sampling parameters of the sequences a GPU runner holds, as columns by slot (issue 33, deliverable 3).

Why: a step's sampler read each row's `SamplingParams` fields one Python attribute at a time — properties
(`plain_greedy`, `host_sampled`, `penalized`) re-derived per row per step, a list per field, a host->device copy
per list (a pinned staging buffer each: ~0.1 ms of host time apiece on an H100 host) — about a third of the GPU
executor's host time at 256 streams. A sequence's params do not change while it runs (they come once per
admission, `SchedulerConfig.history_once` / `attach_state`), so here they are derived once, when a sequence's
params object is first seen, into numpy columns (flags on the host, numbers mirrored on the device); a step then
costs one pass over its rows for (slot, gen_index, pending) and one copy up of those, and every per-row parameter
the sampler wants is a gather (`Step`).

A slot is a sequence's while the runner holds it (`forget` frees it, the plan's `freed`); a share whose params
object is not the one its slot was filled from (a re-admission sends them again) refills it. Host only
bookkeeping plus one device gather: no clock, no randomness.
"""

from __future__ import annotations

import numpy as np
import torch

from imp.kernels.cuda.runtime import to_device
from imp.sampling.slots import Slots
from imp.sampling.works import Works

# the device columns: float32 [cap, 6] and int64 [cap, 2]
F_TEMP, F_TOP_P, F_MIN_P, F_REP, F_PRES, F_FREQ = range(6)
I_TOP_K, I_SEED = range(2)
FLAGS = ("greedy", "plain", "penalized", "bias", "host", "hist", "grammar", "lens", "lora")


class Step:
    """One step's rows as columns: from the shares their slots, gen_index, pending, draft (host int64 [R]) and
    whether each samples, scores prompt tokens, has a guidance shadow or banned tokens (host bool [R]); from
    their params the flags (host bool [R] each, `FLAGS`); and on the device their slots and gen_index (int64
    [R]) and params (`f` [R, 6], `i` [R, 2]) gathered on first use."""

    __slots__ = ("owner", "cols", "sids", "slots", "gen", "pending", "draft", "sample", "plp", "guide", "banned",
                 "_dev", "_f", "_i") + FLAGS

    def __init__(self, owner: RowParams, cols: np.ndarray, sids: list[str]):
        """cols: int64 [R, 8] = slot, gen_index, pending, draft, sample, prompt_logprobs, guide, banned
        (`RowParams.take`); sids: the rows' seq ids."""
        self.owner, self.cols, self.sids = owner, cols, sids
        (self.slots, self.gen, self.pending, self.draft, sample, plp, guide,
         banned) = (np.ascontiguousarray(c) for c in cols.T)
        self.sample, self.plp, self.guide, self.banned = sample > 0, plp >= 0, guide > 0, banned > 0
        slots = self.slots
        for name in FLAGS:
            setattr(self, name, getattr(owner, name)[slots])
        self._dev = self._f = self._i = None

    def __len__(self) -> int:
        return len(self.slots)

    def subset(self, rows) -> Step:
        rows = np.asarray(rows, np.int64)
        sids = self.sids
        return Step(self.owner, self.cols[rows], [sids[r] for r in rows.tolist()])

    def dev(self) -> torch.Tensor:
        """[2, R] int64 on the device: slots, gen_index (one copy up a step)."""
        if self._dev is None:
            self._dev = to_device(torch.from_numpy(np.stack([self.slots, self.gen])), torch.int64, self.owner.device)
        return self._dev

    @property
    def f(self) -> torch.Tensor:
        if self._f is None:
            self._f = self.owner.dev_f().index_select(0, self.dev()[0])
        return self._f

    @property
    def i(self) -> torch.Tensor:
        if self._i is None:
            self._i = self.owner.dev_i().index_select(0, self.dev()[0])
        return self._i


class RowParams:
    def __init__(self, device, cap: int = 64):
        self.device = torch.device(device)
        self.slots = Slots(cap)
        self.obj: list = []  # the params object each slot was filled from
        self.f = np.zeros((0, 6), np.float32)
        self.i = np.zeros((0, 2), np.int64)
        for name in FLAGS:
            setattr(self, name, np.zeros(0, bool))
        self._dev_f = self._dev_i = None
        self._dirty: list[int] = []
        self._grow()

    def _grow(self) -> None:
        cap, old = self.slots.cap, len(self.obj)
        self.obj += [None] * (cap - old)
        self.f = np.concatenate([self.f, np.zeros((cap - old, 6), np.float32)])
        self.i = np.concatenate([self.i, np.zeros((cap - old, 2), np.int64)])
        for name in FLAGS:
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(cap - old, bool)]))
        self._dev_f = self._dev_i = None  # mirrored again, whole, at the next use

    @property
    def cap(self) -> int:
        return self.slots.cap

    def forget(self, seq_ids) -> None:
        for j in self.slots.forget(seq_ids):
            self.obj[j] = None

    def take(self, works) -> Step:
        """The step's rows (complete SeqWorks: params filled in) as columns; a sequence seen for the first time,
        or with a params object other than its slot's, (re)fills its slot."""
        get, obj = self.slots.of.get, self.obj
        general = works.general if isinstance(works, Works) else works
        cols = np.array([(get(w.seq_id, -1), w.gen_index, w.pending, w.draft, w.sample, w.prompt_logprobs,
                          bool(w.guide), bool(w.banned)) for w in general], np.int64).reshape(-1, 8)
        slots = cols[:, 0]
        for r in [r for r, (j, w) in enumerate(zip(slots.tolist(), general)) if j < 0 or obj[j] is not w.params]:
            slots[r] = self._fill(general[r].seq_id, general[r].params)
        if not isinstance(works, Works):
            return Step(self, cols, [w.seq_id for w in general])
        # the decode rows (first): one token fed and sampled, nothing else asked; their params are the ones their
        # sequence's first share filled its slot from (a re-admission sends them again in a general share), so
        # only a slot this runner does not hold yet (a new runner after a suspend) is filled, from the kept params
        rb = works.rows
        rs = np.array([get(sid, -1) for sid in rb.seq_ids], np.int64)
        for r in np.flatnonzero(rs < 0).tolist():
            rs[r] = self._fill(rb.seq_ids[r], rb.params(r))
        R = len(rs)
        rc = np.zeros((R, 8), np.int64)
        rc[:, 0], rc[:, 1], rc[:, 2], rc[:, 4], rc[:, 5] = rs, rb.gen, rb.pending, 1, -1
        return Step(self, np.concatenate([rc, cols]) if len(cols) else rc, works.seq_ids)

    def _fill(self, sid: str, p) -> int:
        j = self.slots.assign(sid)
        if j >= len(self.obj):
            self._grow()
        self.obj[j] = p
        self.f[j] = (p.temperature if p.temperature > 0 else 1.0, p.top_p, p.min_p, p.repetition_penalty,
                     p.presence_penalty, p.frequency_penalty)
        self.i[j] = (p.top_k, p.seed)
        self.greedy[j], self.plain[j], self.penalized[j] = p.greedy, p.plain_greedy, p.penalized
        self.bias[j], self.host[j], self.hist[j] = bool(p.logit_bias), p.host_sampled, p.needs_history
        self.grammar[j], self.lens[j], self.lora[j] = p.constraint is not None, p.logit_lens > 0, bool(p.lora)
        self._dirty.append(j)
        return j

    def _sync(self) -> None:
        if self._dev_f is None:
            self._dev_f = to_device(torch.from_numpy(self.f), torch.float32, self.device)
            self._dev_i = to_device(torch.from_numpy(self.i), torch.int64, self.device)
        elif self._dirty:
            d = sorted(set(self._dirty))
            at = to_device(d, torch.int64, self.device)
            self._dev_f.index_copy_(0, at, to_device(torch.from_numpy(self.f[d]), torch.float32, self.device))
            self._dev_i.index_copy_(0, at, to_device(torch.from_numpy(self.i[d]), torch.int64, self.device))
        self._dirty = []

    def dev_f(self) -> torch.Tensor:
        self._sync()
        return self._dev_f

    def dev_i(self) -> torch.Tensor:
        self._sync()
        return self._dev_i
