"""`imp.kernels.cuda.runtime.to_device`'s staging ring: many small copies in flight at once, the ring wrapped
several times over, every dtype the runners send, all arrive as sent (a segment is never written before the copy
that read it has run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from imp.kernels.cuda import runtime as rt


@pytest.mark.gpu
def test_staged_copies_arrive_as_sent_through_several_wraps_of_the_ring():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(0)
    dev = torch.device("cuda:0")
    big = torch.cuda.Stream(dev)
    sent, got = [], []
    with torch.cuda.stream(big):
        slow = torch.randn(4096, 4096, device=dev)
        for i in range(3 * rt.STAGE_SEGS):
            if i % 64 == 0:
                slow = slow @ slow.T / 4096  # keep the stream busy: the copies queue behind it
            dt = [torch.int64, torch.int32, torch.float32, torch.bool][i % 4]
            n = int(rng.integers(0, 3000)) if i % 50 else rt.STAGE_SEG // 4 + 7  # some span two segments
            a = torch.from_numpy(rng.integers(-1000, 1000, size=n)).to(dt)
            sent.append(a.clone())
            got.append(rt.to_device(a if i % 3 else a.numpy().tolist(), dt, dev))
            a.zero_()  # the caller's array may change at once: the copy was taken
    torch.cuda.synchronize(dev)
    for a, g in zip(sent, got):
        assert g.dtype == a.dtype and g.device.type == "cuda" and torch.equal(g.cpu(), a)
    huge = torch.arange(rt.STAGE_SEG * rt.STAGE_SEGS // 4, dtype=torch.int32)  # past the ring: pinned on its own
    assert torch.equal(rt.to_device(huge, torch.int32, dev).cpu(), huge)
