"""Packed vocabularies (imp/formats/packed.py): the same answers as the lists they replace,
and what the GGUF reader hands out for long arrays."""

from __future__ import annotations

import numpy as np
import pytest

from imp.formats.packed import PackedBytes, PackedStr

TEXTS = ["", "a", "<|im_start|>", "▁the", "é\u2581x", "a", "\U0001F600", "ab", "b"]


def test_packed_str_behaves_like_its_list():
    p = PackedStr.of_str(TEXTS)
    assert len(p) == len(TEXTS) and list(p) == TEXTS and p == TEXTS and p[:3] == TEXTS[:3]
    assert [p[i] for i in range(-len(TEXTS), len(TEXTS))] == TEXTS + TEXTS
    assert p[np.int64(3)] == "▁the"  # ids arrive as numpy ints too
    for t in TEXTS:
        assert t in p and p.index(t) == TEXTS.index(t)  # the first of duplicates
    # a hit inside an item, or across two, is not an item
    for absent in ("im_start", "ab b", "th", "|><", "x", "c"):
        assert absent not in p
        with pytest.raises(ValueError):
            p.index(absent)
    assert 3 not in p and b"a" not in p
    with pytest.raises(IndexError):
        p[len(TEXTS)]
    assert p == PackedStr.of_str(TEXTS) and p != PackedStr.of_str(TEXTS[:-1]) and p != TEXTS[:-1]


def test_packed_bytes_round_trip_and_invalid_utf8():
    items = [b"\xff", b"", b" the", b"\xe2\x96"]
    p = PackedBytes.of(items)
    assert list(p) == items and p[0] == b"\xff" and b" the" in p and p.index_of(b"\xe2") == -1
    s = PackedStr(p.blob, p.offsets)
    assert s[0] == "\ufffd" and s[2] == " the"  # replacement, as GGUF strings always read
    with pytest.raises(ValueError):
        PackedBytes(b"abc", np.array([0, 2], dtype=np.int64))  # offsets must end at the blob's end


def test_reader_packs_long_arrays_and_keeps_short_ones(tmp_path):
    from tests.fixtures.synth import write_synthetic_gguf

    from imp.formats.gguf_file import PACK_FROM, read_header

    path = write_synthetic_gguf(str(tmp_path / "m.gguf"), vocab=PACK_FROM + 8)
    md = read_header(path).metadata
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert isinstance(tokens, PackedStr) and len(tokens) == PACK_FROM + 8
    assert isinstance(types, np.ndarray) and not types.flags.writeable and len(types) == len(tokens)
    assert isinstance(md["tokenizer.ggml.merges"], list)  # one merge: short, a list
    from gguf import GGUFReader  # the reference reader agrees item for item

    ref = GGUFReader(path).fields["tokenizer.ggml.tokens"]
    assert list(tokens) == [bytes(ref.parts[i]).decode() for i in ref.data]


def test_join_equals_joining_the_items():
    rng = np.random.default_rng(0)
    items = [bytes(rng.integers(0, 256, rng.integers(0, 6), dtype=np.uint8)) for _ in range(300)]
    p = PackedBytes.of(items)
    for n in (0, 1, 31, 32, 500):  # both paths: slices below 32 ids, one gather above
        ids = rng.integers(-300, 300, n).tolist()
        assert p.join(ids) == b"".join(items[i] for i in ids)
    assert p.join([i for i in range(300) if not items[i]] * 40) == b""
    with pytest.raises(IndexError):
        p.join(list(range(40)) + [300])


def test_settle_after_boot_freezes_survivors_and_keeps_running():
    import gc

    from imp.settle import settle_after_boot

    kept = [object() for _ in range(1000)]
    before = gc.get_freeze_count()
    try:
        settle_after_boot()
        assert gc.get_freeze_count() >= before + len(kept)  # out of every later collection
        assert gc.collect() >= 0  # collections still run on what comes after
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
