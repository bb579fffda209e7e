"""Penalty counts kept on the device (`imp.sampling.devcounts.DeviceCounts`, the GPU runner's), on CPU tensors:
a pipelined run of penalized sequences (each share's history lacks the token in flight, which sits in the last
step's ids), with recomputes that resend a shorter history, sequences forgotten and their ids reused, rows sampled
elsewhere for a step (a verify, the host), unpenalized rows beside, and a table too small for every sequence (the
rest take the segment path): every step's penalized logits equal the CPU reference over the complete history.
The CUDA kernel is held to the same rule in the GPU lane (tests/test_gpu_kernels.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from imp.messages import SamplingParams, SeqWork
from imp.sampling.cpu import apply_penalties
from imp.sampling.devcounts import DeviceCounts
from imp.sampling.gpu import bias_and_penalties


def _params(rng):
    return SamplingParams(max_tokens=99, repetition_penalty=rng.choice([1.0, 1.05, 1.3, 0.8]),
                          presence_penalty=rng.choice([0.0, 0.5, -0.3]), frequency_penalty=rng.choice([0.0, 0.2]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_counts_equal_the_reference_step_after_step(device):
    """On the GPU: the CUDA kernel (penalize_dense), the device scatters, bit for bit the CPU reference."""
    if device == "cuda":
        from imp.kernels.cuda import runtime

        if not runtime.available():
            pytest.skip("no CUDA / CuPy")
    rng = random.Random(3)
    V = 61
    dc = DeviceCounts(V, device, max_bytes=4 * V * 5)  # 5 rows: the sixth and later sequences take segments
    seqs = {f"s{i}": dict(p=_params(rng), gen=[], inflight=None) for i in range(8)}
    seqs["s7"]["p"] = SamplingParams(max_tokens=99)  # unpenalized beside
    prev_ids, prev_row = None, {}
    checked = 0
    for step in range(80):
        if step == 25:  # s1 recomputed after a preemption: its in-flight token dropped, history resent
            seqs["s1"]["inflight"] = None
        if step == 40:  # s2 ends; its id comes back as a new sequence
            dc.forget(["s2"])
            seqs["s2"] = dict(p=_params(rng), gen=[], inflight=None)
        works, pend_rows, pend_slots = [], [], []
        for sid, s in seqs.items():
            if s["inflight"] is not None:  # pipelined: the token in flight is the last step's, on the device
                pend_rows.append(len(works))
                pend_slots.append(s["inflight"][0])
            n_known = len(s["gen"])
            works.append(SeqWork(seq_id=sid, token_ids=(0,), start_pos=5, block_table=(0,), sample=True,
                                 params=s["p"], history=tuple(s["gen"]), pending=int(s["inflight"] is not None),
                                 gen_index=n_known + (s["inflight"] is not None)))
        logits = torch.randn(len(works), V) * 3
        x = logits.clone().to(device)
        pending = (pend_rows, prev_ids, pend_slots) if pend_rows else None
        dc.drop_taken()
        elsewhere = step in (50, 51, 63)  # s3's row sampled elsewhere (a verify, the host): the table not told,
        if elsewhere:                     # its token in flight all the same; the next step recounts it
            keep = [r for r, w in enumerate(works) if w.seq_id != "s3"]
            sub = [works[r] for r in keep]
            pr = [keep.index(r) for r in pend_rows if r in keep]
            ps = [sl for r, sl in zip(pend_rows, pend_slots) if r in keep]
            xs = x[keep].clone()
            bias_and_penalties(xs, sub, pending=(pr, prev_ids, ps) if pr else None, counts=dc)
            x[keep] = xs
        else:
            bias_and_penalties(x, works, pending=pending, counts=dc)
        for r, (sid, s) in enumerate(seqs.items()):
            if elsewhere and sid == "s3":
                continue
            full = s["gen"] + ([s["inflight"][1]] if s["inflight"] is not None else [])
            want = torch.from_numpy(apply_penalties(logits[r].numpy().copy(), full, s["p"]))
            assert torch.equal(x[r].cpu(), want), (step, sid, full)
            checked += 1
        ids = torch.tensor([rng.randrange(V) for _ in works], dtype=torch.int64, device=device)  # the step's draw
        dc.record(ids[torch.tensor(keep, device=device)] if elsewhere else ids)  # by the penalized call's rows
        for w in works:  # in the table, each row now counts this step's token too: in sync next step, no recount
            if w.seq_id in dc.slot and w.params.penalized and not (elsewhere and w.seq_id == "s3"):
                assert dc.n[dc.slot[w.seq_id]] == w.gen_index + 1, (step, w.seq_id)
        # the step lands: the in-flight tokens become known, this step's ids are in flight
        for r, (sid, s) in enumerate(seqs.items()):
            if s["inflight"] is not None:
                s["gen"].append(s["inflight"][1])
            s["inflight"] = (r, int(ids[r]))
        prev_ids = ids.to(torch.int32)
    assert checked == 80 * 8 - 3
    assert len(dc.slot) == 5 and dc.table.shape == (5, V)  # bounded: the rest went to segments
    dc.forget(list(seqs))
    assert not dc.slot and (dc.n == -1).all() and len(dc.free) == 5


def test_a_step_that_fails_before_its_draw_leaves_nothing_to_record():
    V = 11
    dc = DeviceCounts(V, "cpu")
    p = SamplingParams(max_tokens=9, frequency_penalty=1.0)
    w = [SeqWork(seq_id="a", token_ids=(0,), start_pos=1, block_table=(0,), sample=True, params=p, history=(3, 3))
         ]
    x = torch.zeros(1, V)
    bias_and_penalties(x, w, counts=dc, pending=None, use_numba=False)
    assert x[0, 3] == -2.0 and dc.n[dc.slot["a"]] == 2
    dc.drop_taken()  # the next step begins: the failed step's rows are not recorded
    dc.record(torch.tensor([5]))
    assert dc.n[dc.slot["a"]] == 2 and int(dc.table[dc.slot["a"]].sum()) == 2
    assert np.array_equal(dc.table[dc.slot["a"]].nonzero().flatten().numpy(), [3])
