"""The CPU forward's RoPE tables (imp.model.paged): ggml's float32 angles by repeated multiplication, the
cos / sin of each angle correctly rounded, and a table grown in pieces equal to one built whole, bit for bit."""

from __future__ import annotations

import numpy as np

from imp.model.paged import RopeTables, rope_table_ggml


def _reference(theta: float, dim: int, positions) -> tuple[np.ndarray, np.ndarray]:
    f32 = np.float32
    ts = f32(np.power(f32(theta), f32(-2.0) / f32(dim), dtype=np.float32))
    rows = []
    for p in positions:
        a, row = f32(p), []
        for _ in range(dim // 2):
            row.append(a)
            a = f32(a * ts)
        rows.append(row)
    a64 = np.asarray(rows, dtype=np.float32).astype(np.float64)
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


def test_the_tables_are_ggml_s_angles_and_grow_without_changing_a_bit():
    for theta, dim in ((10000.0, 64), (1_000_000.0, 256)):
        cos, sin = rope_table_ggml(theta, dim, 4096)
        pick = [0, 1, 17, 1023, 4095]
        rc, rs = _reference(theta, dim, pick)
        assert np.array_equal(cos[pick], rc) and np.array_equal(sin[pick], rs)
        t = RopeTables(theta, dim, 4096)
        t.upto(10)
        c2, s2 = t.upto(3000)  # grown: 1,024 rows, then to 4,096
        assert c2.shape[0] == 4096 and np.array_equal(c2, cos) and np.array_equal(s2, sin)
