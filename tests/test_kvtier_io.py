"""imp.actors.kvtier_io: the tier's files read a chunk at a time and summed without the GIL, and KvTier's chunk
fetch over it (host hits, files, missing and bad files side by side in one chunk)."""

from __future__ import annotations

import logging

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from imp.actors import kvtier, kvtier_io


def _reference_sums(b: bytes) -> tuple[int, int]:
    """The digest's two sums written out with Python integers: every whole 64-bit word, and each whole 4 KB
    page's sum times 1, 3, 5, ... (mod 2**64)."""
    words = [int.from_bytes(b[i:i + 8], "little") for i in range(0, len(b) // 8 * 8, 8)]
    pages = [sum(words[j:j + 512]) for j in range(0, len(words) // 512 * 512, 512)]
    return sum(words) % 2**64, sum(p * (2 * j + 1) for j, p in enumerate(pages)) % 2**64


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=3 * 4096 + 40))
def test_the_compiled_sums_are_the_digests_definition(b):
    assert kvtier_io.sums(b) == _reference_sums(b)


def test_wrapping_sums_of_large_words():
    b = b"\xff" * (4096 * 3 + 16)  # every word 2**64 - 1: the sums wrap many times
    assert kvtier_io.sums(b) == _reference_sums(b)
    assert kvtier_io.sums(bytearray(b)) == kvtier_io.sums(np.frombuffer(b, np.uint8))


def test_read_files_puts_each_payload_in_its_slot_and_says_what_each_file_was(tmp_path):
    size, head = 4096 + 24, 10
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(5)]
    paths = []
    for i, b in enumerate(blocks):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * head + b)
        paths.append(p)
    paths[2].write_bytes(paths[2].read_bytes() + b"x")  # one byte too many
    paths[3].write_bytes(b"abc")  # shorter than a head
    paths[4].write_bytes(paths[4].read_bytes()[:-5])  # a short payload
    (tmp_path / "dir").mkdir()  # opens, but every read fails (EISDIR): a read error, not a bad file
    names = [str(p).encode() for p in paths] + [str(tmp_path / "none").encode(), str(tmp_path / "dir").encode()]
    out = np.zeros(7 * size, np.uint8)
    heads, got, sums = kvtier_io.read_files(names, head, out, size, slots=[6, 0, 1, 2, 3, 4, 5])
    assert got.tolist() == [size, size, kvtier_io.LONGER, kvtier_io.SHORT_HEAD, size - 5, kvtier_io.NO_FILE,
                            kvtier_io.FAILED]
    assert out[6 * size:].tobytes() == blocks[0] and out[:size].tobytes() == blocks[1]
    assert heads[0].tobytes() == bytes([0]) * head and heads[1].tobytes() == bytes([1]) * head
    assert tuple(int(x) for x in sums[0]) == _reference_sums(blocks[0])
    assert tuple(int(x) for x in sums[1]) == _reference_sums(blocks[1])
    heads, got, sums = kvtier_io.read_files([str(paths[1]).encode()], head, out, size)  # slot 0 by default
    assert got.tolist() == [size] and out[:size].tobytes() == blocks[1]
    try:
        kvtier_io.read_files([str(paths[1]).encode()], head, out, size, slots=[7])
    except ValueError:
        pass
    else:
        raise AssertionError("a slot past the buffer was written")


def test_a_chunk_fetch_takes_host_hits_files_and_misses_side_by_side(tmp_path, caplog):
    """KvTier.fetch_many: slot i gets key i's payload from host memory or its file; a missing file is "" without
    a word, a corrupt one "" with its log line and the file removed; a file read is kept in host memory."""
    size = 8192 + 8
    t = kvtier.KvTier(tmp_path, "a" * 64, "float16:2x16x1x8", host_blocks=2)
    rng = np.random.default_rng(5)
    keys = [bytes([i]) * 32 for i in range(5)]
    pay = {k: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for k in keys}
    for k in keys[:4]:
        assert t.save(k, pay[k])
    assert list(t.host) == keys[2:4]  # keys 0 and 1 on disk only
    bad = t._path(keys[1])
    data = bytearray(bad.read_bytes())
    data[-100] ^= 1
    bad.write_bytes(bytes(data))
    out = np.zeros(6 * size, np.uint8)
    with caplog.at_level(logging.WARNING, logger="imp.kvtier"):
        where = t.fetch_many([keys[3], keys[0], keys[1], keys[4], keys[2]], size, out)
    assert where == ["host", "disk", "", "", "host"]
    assert out[:size].tobytes() == pay[keys[3]] and out[size:2 * size].tobytes() == pay[keys[0]]
    assert out[4 * size:5 * size].tobytes() == pay[keys[2]]
    assert "corrupt" in caplog.text and not bad.exists() and caplog.text.count("[kvtier]") == 1
    t._path(keys[4]).mkdir()  # unreadable where a file should be: not used, not removed, no log line
    caplog.clear()
    assert t.fetch_many([keys[4]], size, out) == [""] and t._path(keys[4]).is_dir() and "[kvtier]" not in caplog.text
    t._path(keys[4]).rmdir()
    assert keys[0] in t.host and t.host[keys[0]] == pay[keys[0]]  # read from disk: now in host memory
    assert t.loaded == 1 and t.host_hits == 2
    alone = kvtier.KvTier(None, "a" * 64, "x")
    assert alone.fetch_many(keys[:2], size, out) == ["", ""]
