"""The mixed-step split of the GPU runner (`GpuModelRunner._eager_logits`), on the CPU: a fake
forward that answers each head row with (token, position, pending slot) shows that the rows of
the reordered step (prompt shares first, one forward with `Meta.split`) come back in the order of the unsplit step's head rows, for prompt chunks, decodes,
PENDING_TOKEN rows, prompt-logprob rows and shares that sample nothing."""

from __future__ import annotations

import msgspec
import torch

from imp.gpu.runner import GpuModelRunner
from imp.messages import PENDING_TOKEN, SamplingParams, SeqWork
from imp.model.rows import head_rows


class FakeForward:
    def __init__(self):
        self.calls, self.splits = [], []

    def __call__(self, m, lora=None):
        self.calls.append(int(m.tokens.shape[0]))
        self.splits.append(m.split)
        if m.split is not None:  # the one-token shares come last: attention takes them in place
            assert m.dec_from == m.split[0]
        pend = torch.full((m.tokens.shape[0],), -1.0)
        if m.pending is not None:
            rows, src, k = m.pending
            pend[rows.long()[:k]] = src.float()[:k]
        rows = m.out_rows.long()
        return torch.stack([m.tokens.float()[rows], m.positions.float()[rows], pend[rows]], 1)


def _runner(split: bool) -> GpuModelRunner:
    r = object.__new__(GpuModelRunner)  # no device: only the split's bookkeeping runs
    r.block_size, r.device, r._split_mixed, r.fwd = 16, torch.device("cpu"), split, FakeForward()
    return r


def test_split_rows_come_back_in_the_unsplit_order():
    g = SamplingParams(max_tokens=8)
    seqs = [
        SeqWork(seq_id="d0", token_ids=(PENDING_TOKEN,), start_pos=20, block_table=(0, 1), sample=True, params=g,
                pending=1),
        SeqWork(seq_id="p0", token_ids=tuple(range(100, 130)), start_pos=0, block_table=(2, 3), sample=True, params=g),
        SeqWork(seq_id="d1", token_ids=(7,), start_pos=5, block_table=(4,), sample=True, params=g),
        SeqWork(seq_id="p1", token_ids=tuple(range(200, 210)), start_pos=16, block_table=(5, 6), sample=False,
                params=g),  # a middle chunk: no head row
        SeqWork(seq_id="p2", token_ids=tuple(range(300, 306)), start_pos=0, block_table=(7,), sample=True, params=g,
                prompt_logprobs=1, prompt_next=9),
        SeqWork(seq_id="d2", token_ids=(PENDING_TOKEN,), start_pos=9, block_table=(8,), sample=True, params=g,
                pending=1),
    ]
    src = {0: 3, 5: 1}  # share -> previous step's slot
    rows, _, _ = head_rows(seqs)
    want = _runner(False)._eager_logits(seqs, rows, src, None)
    split = _runner(True)
    got = split._eager_logits(seqs, rows, src, None)
    # one forward: the prompt chunks' 46 rows first (their head rows: p0's, p2's 6 + 1), the decodes after
    assert split.fwd.calls == [49] and split.fwd.splits == [(46, 8)]
    assert torch.equal(got, want) and got.shape[0] == len(rows) == 11  # p2: 6 prompt-logprob rows + its sample
    assert want[0].tolist() == [0.0, 20.0, 3.0] and want[-1].tolist() == [0.0, 9.0, 1.0]  # pending rows remapped


def test_no_split_for_steps_of_one_kind_or_adapters():
    g = SamplingParams(max_tokens=8)
    dec = [SeqWork(seq_id=str(i), token_ids=(i,), start_pos=3, block_table=(i,), sample=True, params=g)
           for i in range(3)]
    pre = [SeqWork(seq_id="p", token_ids=(1, 2, 3), start_pos=0, block_table=(9,), sample=True, params=g)]
    for seqs, lora in ((dec, None), (pre, None), (pre + dec, object())):
        r = _runner(True)
        rows, _, _ = head_rows(seqs)
        r._eager_logits(seqs, rows, {}, lora)
        assert len(r.fwd.calls) == 1


def test_int8_paths_quantize_once_and_fill_each_part_s_columns(monkeypatch):
    """Linear's GEMV and GEMM on int8 activations share one driver: x quantized once (unless the producer
    did), each part's kernel writing its own column slice. Kernels replaced by fakes: runs on the CPU."""
    import torch

    from imp.gpu import linear as L
    from imp.kernels.cuda.quant_weight import QWeight

    parts = [QWeight("Q4_K", 3, 256, {}), QWeight("Q4_K", 5, 256, {})]
    lin = L.Linear(parts, None, {}, int8_act=False)
    quantized = []

    class XA:
        def __init__(self, n):
            self.xq = torch.zeros(n, 256, dtype=torch.int8)
            self.shape = (n, 256)

    monkeypatch.setattr(L.quantize_act_int8, "quantize", lambda x: quantized.append(x) or XA(x.shape[0]))
    seen = []

    def fake(p, xa, o, **kw):
        seen.append((p.rows, tuple(o.shape), kw))
        o.fill_(float(p.rows))

    monkeypatch.setattr(L.gemv_int8_act, "gemv", fake)
    monkeypatch.setattr(L.gemm_int8_act, "qmm", fake)
    name = next(iter(L.gemv_int8_act.VARIANTS))
    rows, split = L.gemv_int8_act.VARIANTS[name]
    out = lin.gemv_q8(torch.zeros(2, 256), name)
    assert len(quantized) == 1 and out.shape == (2, 8)
    assert out[:, :3].eq(3).all() and out[:, 3:].eq(5).all()
    assert seen == [(3, (2, 3), {"rows": rows, "split": split}), (5, (2, 5), {"rows": rows, "split": split})]
    seen.clear()
    out = lin.qmm(None, XA(4))  # quantized by its producer: not again
    assert len(quantized) == 1 and out.shape == (4, 8) and [s[:2] for s in seen] == [(3, (4, 3)), (5, (4, 5))]


def test_by_kind_runs_each_row_range_on_its_kind_s_kernel(monkeypatch):
    """`Linear.by_kind`: prompt rows [0, P) on the dense copy, decode rows [P, N) on the int8 GEMV, each into
    its own rows of one output (kernels faked: runs on the CPU)."""
    from imp.gpu import linear as L
    from imp.kernels.cuda.quant_weight import QWeight

    lin = L.Linear([QWeight("Q4_1", 4, 64, {})], torch.ones(4, 64, dtype=torch.float16), {}, int8_act=True)
    assert lin.mode(3, prompt=True) == "dense" and lin.mode(2) in L.gemv_int8_act.VARIANTS
    dense_rows = []

    def fake_dense(x, out=None):
        dense_rows.append(x.shape[0])
        y = torch.full((x.shape[0], 4), 7.0)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(lin, "dense_mm", fake_dense)
    got = []

    def fake_gemv(p, xa, o, **kw):
        got.append(tuple(xa.xq.shape))
        o.fill_(-1.0)

    monkeypatch.setattr(L.gemv_int8_act, "gemv", fake_gemv)
    monkeypatch.setattr(L.quantize_act_int8, "quantize", lambda x: L.quantize_act_int8.Q8Act(torch.zeros(x.shape, dtype=torch.int8),
                                                                       torch.zeros(x.shape[0], x.shape[1] // 32, 2)))
    out = lin.by_kind(3, torch.randn(5, 64))
    assert out[:3].eq(7).all() and out[3:].eq(-1).all() and got == [(2, 64)]  # decode rows alone quantized
    assert lin.by_kind(5, torch.randn(5, 64)).eq(7).all() and len(got) == 1  # no decode rows: no GEMV
    # decode rows past GEMV_MAX_ROWS take the dense copy as prompt rows do: one call over all rows (the weight
    # read once, one launch), not one per kind
    dense_rows.clear()
    D = L.GEMV_MAX_ROWS + 1
    assert lin.mode(D) == "dense"
    assert lin.by_kind(3, torch.randn(3 + D, 64)).eq(7).all() and dense_rows == [3 + D] and len(got) == 1


def test_by_kind_one_call_on_the_int8_gemm_when_both_kinds_take_it(monkeypatch):
    """Without a dense copy, prompt rows and decode rows past GEMV_MAX_ROWS both take the int8 GEMM, whose
    bits do not depend on M: one GEMM over all rows; at GEMV_MAX_ROWS decode rows or fewer, two kernels."""
    from imp.gpu import linear as L
    from imp.kernels.cuda.quant_weight import QWeight

    lin = L.Linear([QWeight("Q4_1", 4, 64, {})], None, {}, int8_act=True)
    calls = []
    monkeypatch.setattr(lin, "run", lambda name, x, xa=None, out=None: calls.append((name, x.shape[0])) or
                        (torch.zeros(x.shape[0], 4) if out is None else out))
    lin.by_kind(16, torch.randn(16 + 12, 64))
    assert calls == [("qmm", 28)]
    calls.clear()
    lin.by_kind(16, torch.randn(16 + 4, 64))
    assert [c[0] for c in calls] == ["qmm", lin.mode(4)] and lin.mode(4) in L.gemv_int8_act.VARIANTS


class NextTokenForward:
    """A model whose greedy next token is the fed token + 1 (one-hot logits over 64 ids)."""

    def __call__(self, m, lora=None):
        rows = m.out_rows.long()
        return torch.nn.functional.one_hot((m.tokens.long()[rows] + 1) % 64, 64).float()


def _verify_runner(monkeypatch):
    """A `host_only` GPU runner (CPU tensors, its real sampling and landing) with a next-token-is-token+1 model,
    every step laid out eagerly."""
    r = GpuModelRunner.host_only(vocab=64, block_size=16, num_blocks=64, context_length=512, max_batch=8)
    r.fwd = NextTokenForward()
    monkeypatch.setattr(r.graphs, "fits", lambda seqs, one=None: False)
    return r


def _verify_shares():
    g = SamplingParams(max_tokens=8)
    return [
        SeqWork(seq_id="v0", token_ids=(10, 11, 12, 20), start_pos=30, block_table=(0, 1, 2), sample=True, params=g,
                draft=3),  # keeps 11, 12; 20 is wrong: samples 13
        SeqWork(seq_id="d", token_ids=(40,), start_pos=5, block_table=(3,), sample=True, params=g),
        SeqWork(seq_id="p", token_ids=tuple(range(50, 58)), start_pos=0, block_table=(4,), sample=True, params=g),
        SeqWork(seq_id="v1", token_ids=(1, 2, 3, 4, 5), start_pos=60, block_table=tuple(range(5, 10)), sample=True,
                params=g, draft=2),  # 1, 2 written as a chunk; 3 known, draft 4, 5 all kept: samples 6
    ]


def test_verify_step_flattens_drafts_into_one_token_rows_and_keeps_the_agreeing_prefix(monkeypatch):
    """The GPU runner's verify step (`_verify_step`), on the CPU with a next-token-is-token+1 model: each verify
    share's drafted positions run as one-token rows in the step's order (a longer share's leading tokens as a
    chunk that samples nothing), the plain rows are sampled as usual, and a draft is kept up to the first
    position whose greedy token differs, in the order of the step's sampled shares. The step lands as a
    `VerifyLanding` (its ids in one ring slot, read when collected), and the plain rows' ids are where the
    next step's PENDING_TOKEN rows read them (the previous step's landing and sampled buffer)."""
    from imp.gpu.inputs import VerifyLanding

    r = _verify_runner(monkeypatch)
    h = r._verify_step(_verify_shares(), {}, None, None)
    assert isinstance(h, VerifyLanding)
    out = r.collect(h)
    assert [t.seq_id for t in out] == ["v0", "d", "p", "v1"]
    assert [(t.token_id, [a.token_id for a in t.accepted]) for t in out] == [
        (13, [11, 12]), (41, []), (58, []), (6, [4, 5])]
    assert all(a.seq_id == t.seq_id for t in out for a in t.accepted)
    assert r._prev.seq_ids == ["d", "p"] and r._sampled[:2].tolist() == [41, 58]  # the plain rows feed the next step
    sids, ids, tokens = r.collect_ids(h)
    assert sids is None and tokens == out and h.ids() == [13, 41, 58, 6]
    # a plain row drawn on the host (logprobs asked) keeps what the host drew: its logprob and top ids
    shares = _verify_shares()
    shares[1] = msgspec.structs.replace(shares[1], params=SamplingParams(max_tokens=8, logprobs=2))
    out = r.collect(r._verify_step(shares, {}, None, None))
    assert [t.token_id for t in out] == [13, 41, 58, 6] and out[1].top and out[1].top[0][0] == 41


def test_a_verify_step_of_drafts_alone_and_one_drawn_on_the_host_give_the_same_tokens(monkeypatch):
    """No plain rows: the drafted ids take a ring slot of their own and nothing feeds the next step. A step with
    prompt logprobs: everything drawn at launch (`_verify_now`), the same tokens."""
    from imp.gpu.inputs import VerifyLanding

    r = _verify_runner(monkeypatch)
    shares = [s for s in _verify_shares() if s.draft]
    h = r._verify_step(shares, {}, None, None)
    assert isinstance(h, VerifyLanding) and r._prev_sids == []
    want = [(13, [11, 12]), (6, [4, 5])]
    assert [(t.token_id, [a.token_id for a in t.accepted]) for t in r.collect(h)] == want
    r2 = _verify_runner(monkeypatch)
    calls = []
    now, head = r2._verify_now, r2._head_logits

    def head_with_plp(flat, fsrc, la):  # as if a share asked for prompt logprobs
        logits, row_of, _ = head(flat, fsrc, la)
        return logits, row_of, {0: [0]}

    monkeypatch.setattr(r2, "_verify_now", lambda *a: calls.append(1) or now(*a))
    monkeypatch.setattr(r2, "_head_logits", head_with_plp)
    monkeypatch.setattr("imp.gpu.runner.with_prompt_logprobs",
                        lambda flat, drawn, plp_at, logits: [drawn[k] for k in sorted(drawn)])
    got = r2.collect(r2._verify_step(shares, {}, None, None))
    assert calls == [1] and [(t.token_id, [a.token_id for a in t.accepted]) for t in got] == want


def test_a_verify_steps_penalty_counts_are_the_recounted_ones_with_each_history_counted_once():
    """`_draft_counts`: position j of a penalized verify share samples after its history and the draft's first j
    tokens; the counts (kept per sequence across verifies, a position's draft tokens added) pack the same
    penalty segments as counting every position's whole history anew, step after step as histories grow (new
    ids, repeats, ids past the vocabulary), and a forgotten sequence starts again."""
    import numpy as np

    from imp.sampling.gpu import penalty_segments

    V = 50
    r = GpuModelRunner.host_only(vocab=V, block_size=16, num_blocks=64, context_length=512, max_batch=8)
    pen = SamplingParams(max_tokens=99, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1)
    rng = np.random.default_rng(5)
    hists = {"a": [3, 3, 7], "b": [], "c": [49, 60]}
    for step in range(6):
        shares = []
        for sid, h in hists.items():
            d = tuple(int(x) for x in rng.integers(0, V + 3, 1 + step % 4))  # (some past the vocabulary)
            shares.append(SeqWork(seq_id=sid, token_ids=(int(rng.integers(0, V)),) + d, start_pos=40 + step,
                                  block_table=(0, 1, 2), sample=True, params=pen, draft=len(d), history=tuple(h)))
        works = [wj for w in shares for wj in r._draft_works(w)]
        got = penalty_segments(works, None, V, r._draft_counts(shares, V))
        want = penalty_segments(works, None, V, None)
        assert got[1] == want[1] > 0 and np.array_equal(got[0], want[0])
        for sid, h in hists.items():  # the verify kept some of the draft and sampled one more
            h.extend(int(x) for x in rng.integers(0, V, 1 + step % 3))
        if step == 3:
            r.forget(["a"])
            hists["a"] = [9]


def test_penalized_verify_shares_keep_their_counts_across_steps_and_forget_them(monkeypatch):
    """Penalized verify shares (a history each) through `_verify_step` and through `_verify` (the host path):
    the one-hot next-token model's tokens, each share's history counted once and kept for its next verify
    (`_draft_hist`), dropped when the runner forgets the sequence."""
    r = _verify_runner(monkeypatch)
    pen = SamplingParams(max_tokens=8, repetition_penalty=1.3, presence_penalty=0.1)
    shares = [msgspec.structs.replace(s, params=pen, history=(10, 11, 9, 9) if s.draft else (1,))
              for s in _verify_shares()]
    want = [(13, [11, 12]), (41, []), (58, []), (6, [4, 5])]
    assert [(t.token_id, [a.token_id for a in t.accepted]) for t in r.collect(r._verify_step(shares, {}, None, None))
            ] == want
    assert set(r._draft_hist._by) == {"v0", "v1"} and r._draft_hist._by["v0"][0] == 4
    grown = [msgspec.structs.replace(s, history=s.history + (11, 12, 13)) if s.draft else s for s in shares]
    t = r._verify(torch.nn.functional.one_hot(torch.tensor([11, 12, 13, 21]), 64).float(), grown[0], None)
    assert (t.token_id, [a.token_id for a in t.accepted]) == (13, [11, 12]) and r._draft_hist._by["v0"][0] == 7
    r.forget(["v0", "v1"])
    assert not len(r._draft_hist)
