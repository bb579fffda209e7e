"""The GPU runner's plan check (imp.gpu.inputs.check): a bad share is a ValueError (the step fails, its
requests end), never a device fault; a table already found in range is not scanned again while the
scheduler hands the same tuple on, and a changed or longer one is. CPU only (no device needed)."""

from __future__ import annotations

import pytest

from imp.gpu.inputs import check
from imp.messages import SeqWork


def _w(sid: str, pos: int, table: tuple[int, ...], n: int = 1) -> SeqWork:
    return SeqWork(sid, (5,) * n, pos, table, True, None)


def test_bad_shares_are_value_errors():
    with pytest.raises(ValueError, match="beyond context length"):
        check([_w("a", 100, (0,) * 8)], 100, 16, 64)
    with pytest.raises(ValueError, match="block table too short"):
        check([_w("a", 40, (0, 1))], 4096, 16, 64)
    with pytest.raises(ValueError, match="block id out of range"):
        check([_w("a", 20, (0, 64))], 4096, 16, 64)
    with pytest.raises(ValueError, match="no tokens"):
        check([SeqWork("a", (), 0, (0,), True, None)], 4096, 16, 64)


def test_a_table_seen_in_range_is_not_scanned_again_but_a_new_one_is():
    seen: dict = {}
    good = (3, 4, 5)
    check([_w("a", 20, good)], 4096, 16, 64, seen)  # positions 0..20: blocks 0..1 checked
    assert seen["a"] == (good, 2)
    check([_w("a", 21, good)], 4096, 16, 64, seen)  # the same tuple within what was checked: skipped
    bad = (3, 4, 99)  # a new tuple (a grow): scanned, its bad block found once the position reaches it
    check([_w("a", 20, bad)], 4096, 16, 64, seen)
    with pytest.raises(ValueError, match="block id out of range"):
        check([_w("a", 33, bad)], 4096, 16, 64, seen)
    longer = (3, 4, 64)  # the same object reaching past what was checked is scanned too
    check([_w("b", 5, longer)], 4096, 16, 64, seen)
    with pytest.raises(ValueError, match="block id out of range"):
        check([_w("b", 40, longer)], 4096, 16, 64, seen)
