"""KV allocator: unit tests and a property test against simulated KV memory."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from imp.core.core import CoreError
from imp.core.kv import KvConfig, KvCore
from imp.messages import KvForget, KvOp, KvRequest

BS = 4


def run(kv: KvCore, *ops: KvOp):
    (receiver, reply), = kv.handle("scheduler", KvRequest(1, tuple(ops)))
    assert receiver == "scheduler"
    kv.audit()
    return reply


def alloc(seq, tokens, num=None, salt=""):
    return KvOp("alloc", seq, len(tokens) if num is None else num, tuple(tokens), salt=salt)


def free(seq, written=()):
    return KvOp("free", seq, token_ids=tuple(written))


def test_alloc_grow_free_figures():
    kv = KvCore(KvConfig(num_blocks=8, block_size=BS))
    r = run(kv, alloc("a", range(6)))
    assert r.results[0].ok and len(r.results[0].block_table) == 2 and r.results[0].cached_tokens == 0
    assert (r.figures.used, r.figures.free) == (2, 6)
    r = run(kv, KvOp("grow", "a", 9, tuple(range(6))))
    assert len(r.results[0].block_table) == 3
    r = run(kv, free("a"))
    assert r.results == () and r.figures.free == 8 and r.figures.cached == 1  # the one full written block


def test_prefix_hit_needs_written_tokens_and_keeps_last_token():
    kv = KvCore(KvConfig(8, BS, "model-x"))
    prompt = list(range(8))  # exactly two blocks
    run(kv, alloc("a", prompt))
    # nothing written yet: a twin prompt must not reuse blocks still being computed
    r = run(kv, alloc("b", prompt))
    assert r.results[0].cached_tokens == 0
    run(kv, free("a", prompt), free("b"))
    r = run(kv, alloc("c", prompt))
    # both blocks are cached, but the last token's block is computed again
    assert r.results[0].cached_tokens == 4
    r = run(kv, alloc("d", prompt + [99]))
    assert r.results[0].cached_tokens == 8


def test_salt_and_fingerprint_separate_cache_entries():
    kv = KvCore(KvConfig(8, BS, "fp"))
    prompt = list(range(9))
    run(kv, alloc("a", prompt))
    run(kv, free("a", prompt[:8]))
    assert run(kv, alloc("lora", prompt, salt="adapter")).results[0].cached_tokens == 0
    assert run(kv, alloc("base", prompt)).results[0].cached_tokens == 8
    assert KvCore(KvConfig(8, BS, "fp"))._root("") != KvCore(KvConfig(8, BS, "other"))._root("")


def test_lru_eviction_oldest_release_first():
    kv = KvCore(KvConfig(4, BS))
    for name, base in (("a", 100), ("b", 200)):
        toks = [base + i for i in range(5)]
        run(kv, alloc(name, toks))
        run(kv, free(name, toks[:4]))  # one cached block each; a released first
    r = run(kv, alloc("c", list(range(12))))  # 3 blocks: 2 clean + evicts the LRU one (a's)
    assert r.results[0].ok and r.figures.evictions == 1 and r.figures.cached == 1
    run(kv, free("c"))
    assert run(kv, alloc("a2", [100, 101, 102, 103, 7])).results[0].cached_tokens == 0
    assert run(kv, alloc("b2", [200, 201, 202, 203, 7])).results[0].cached_tokens == 4


def test_fork_shares_full_prompt_blocks_only():
    kv = KvCore(KvConfig(8, BS))
    prompt = list(range(10))
    parent = run(kv, alloc("p", prompt)).results[0].block_table
    r = run(kv, KvOp("fork", "c", 10, prompt, parent="p"))
    child = r.results[0]
    assert child.ok and child.cached_tokens == 8
    assert child.block_table[:2] == parent[:2] and child.block_table[2] != parent[2]
    assert kv.refcount[parent[0]] == 2
    run(kv, free("p"), free("c"))
    assert kv.figures().free == 8


def test_failure_latches_for_later_ops_in_the_request():
    kv = KvCore(KvConfig(4, BS))
    run(kv, alloc("a", range(8)))
    r = run(kv, alloc("big", range(12)), alloc("small", range(3)), KvOp("grow", "a", 8))
    assert [x.ok for x in r.results] == [False, False, True]  # the grow needs no block
    assert r.figures.used == 2
    assert run(kv, alloc("small", range(3))).results[0].ok  # next request: fresh chance


def test_protocol_errors():
    kv = KvCore(KvConfig(4, BS))
    with pytest.raises(CoreError):
        kv.handle("scheduler", KvRequest(1, [KvOp("grow", "nobody", 4)]))
    with pytest.raises(CoreError):
        kv.handle("scheduler", KvRequest(1, [KvOp("explode", "a")]))
    with pytest.raises(ValueError):
        KvConfig(num_blocks=0)


class KvMachine(RuleBasedStateMachine):
    """Random alloc/fork/grow/free sequences. A model of KV memory records
    what each block holds; a sequence must always find its own tokens in its
    table (prefix hits and forks included) and never share the block it writes."""

    def __init__(self):
        super().__init__()
        self.kv = KvCore(KvConfig(num_blocks=10, block_size=BS, fingerprint="m"))
        self.mem: dict[int, list] = {}  # block -> [(salt, token) per slot]
        self.seqs: dict[str, dict] = {}  # seq -> tokens, written, table, salt
        self.n = 0

    def _write(self, name, upto):
        s = self.seqs[name]
        for p in range(s["written"], upto):
            self.mem.setdefault(s["table"][p // BS], [None] * BS)[p % BS] = (s["salt"], s["tokens"][p])
        new = s["tokens"][s["written"]:upto]
        s["written"] = upto
        return new

    @rule(length=st.integers(1, 14), family=st.integers(0, 2), salt=st.sampled_from(["", "l"]))
    def alloc(self, length, family, salt):
        self.n += 1
        name, tokens = f"s{self.n}", [family * 100 + i for i in range(length)]
        r = run(self.kv, alloc(name, tokens, salt=salt)).results[0]
        if r.ok:
            self.seqs[name] = dict(tokens=tokens, written=r.cached_tokens, table=r.block_table, salt=salt)
            assert r.cached_tokens < length

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        p = self.seqs[parent]
        self._write(parent, len(p["tokens"]))  # the prompt is computed before siblings fork
        self.n += 1
        name = f"s{self.n}"
        r = run(self.kv, KvOp("fork", name, len(p["tokens"]), p["tokens"], parent=parent, salt=p["salt"])).results[0]
        if r.ok:
            self.seqs[name] = dict(tokens=list(p["tokens"]), written=r.cached_tokens, table=r.block_table, salt=p["salt"])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.integers(0, 6))
    def grow(self, data, extra):
        name = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[name]
        new = self._write(name, len(s["tokens"]))
        s["tokens"] += [7000 + len(s["tokens"]) + i for i in range(extra)]
        r = run(self.kv, KvOp("grow", name, len(s["tokens"]), new)).results[0]
        if r.ok:
            s["table"] = r.block_table
        else:
            del s["tokens"][len(s["tokens"]) - extra:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), write=st.booleans())
    def free(self, data, write):
        name = data.draw(st.sampled_from(sorted(self.seqs)))
        new = self._write(name, len(self.seqs[name]["tokens"])) if write else []
        run(self.kv, free(name, new))
        del self.seqs[name]

    @invariant()
    def tables_hold_what_they_wrote(self):
        self.kv.audit()
        writing = {}
        for name, s in self.seqs.items():
            assert len(s["table"]) * BS >= len(s["tokens"])
            for p in range(s["written"]):
                assert self.mem[s["table"][p // BS]][p % BS] == (s["salt"], s["tokens"][p]), (name, p)
            if s["written"] < len(s["tokens"]):  # the block it writes next is its own
                b = s["table"][s["written"] // BS]
                assert b not in writing and self.kv.refcount[b] == 1, (name, writing.get(b))
                writing[b] = name
        used = {b for s in self.seqs.values() for b in s["table"]}
        assert self.kv.figures().used == len(used)


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SharingKvMachine(KvMachine):
    """The same, with allocs waiting for prompt blocks another sequence is computing (share_in_flight):
    audit checks the promises after every op; a wait names a block some live sequence will write."""

    def __init__(self):
        super().__init__()
        self.kv = KvCore(KvConfig(num_blocks=10, block_size=BS, fingerprint="m", share_in_flight=True))

    @rule(length=st.integers(1, 14), family=st.integers(0, 2), salt=st.sampled_from(["", "l"]))
    def alloc(self, length, family, salt):
        before = dict(self.kv.promised)
        self.n += 1
        name, tokens = f"s{self.n}", [family * 100 + i for i in range(length)]
        r = run(self.kv, alloc(name, tokens, salt=salt)).results[0]
        if r.wait:
            assert not r.ok and before and self.kv.promised == before
        elif r.ok:
            self.seqs[name] = dict(tokens=tokens, written=r.cached_tokens, table=r.block_table, salt=salt)
            assert r.cached_tokens < length


TestSharingKvMachine = SharingKvMachine.TestCase
TestSharingKvMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_an_alloc_waits_for_prompt_blocks_in_flight_and_then_hits_them():
    kv = KvCore(KvConfig(16, BS, "m", share_in_flight=True))
    prompt = list(range(10))  # two full blocks before the last token's
    assert run(kv, alloc("a", prompt)).results[0].ok
    r = run(kv, alloc("b", prompt), alloc("c", [50, 51, 52, 53, 54]))
    assert r.results[0].wait and not r.results[0].ok  # a is computing those blocks
    assert r.results[1].ok  # a wait is no shortage: the op behind it runs
    assert kv.waits == 1
    run(kv, KvOp("grow", "a", 11, tuple(prompt)))  # a's prompt is written: its blocks are cached
    r = run(kv, alloc("b", prompt)).results[0]
    assert r.ok and not r.wait and r.cached_tokens == 8
    # a short prompt's own last block is never waited for, nor a different salt's
    assert run(kv, alloc("d", prompt[:4])).results[0].ok
    run(kv, alloc("e", list(range(100, 110))))
    assert run(kv, alloc("f", list(range(100, 110)), salt="lora")).results[0].ok


def test_a_freed_or_forgotten_promise_is_not_waited_for():
    kv = KvCore(KvConfig(16, BS, "m", share_in_flight=True))
    prompt = list(range(10))
    run(kv, alloc("a", prompt))
    run(kv, free("a"))  # preempted before it wrote anything
    r = run(kv, alloc("b", prompt)).results[0]
    assert r.ok and r.cached_tokens == 0  # b computes it now, and promises it
    assert run(kv, alloc("c", prompt)).results[0].wait
    kv.handle("scheduler", KvForget())
    kv.audit()
    assert run(kv, alloc("c", prompt)).results[0].ok  # after a suspend nothing in flight will be cached


def test_without_share_in_flight_twins_compute_side_by_side():
    kv = KvCore(KvConfig(16, BS, "m"))
    prompt = list(range(10))
    run(kv, alloc("a", prompt))
    r = run(kv, alloc("b", prompt)).results[0]
    assert r.ok and not r.wait and r.cached_tokens == 0 and not kv.promised


def pin(key, tokens, salt=""):
    return KvOp("pin", key, token_ids=tuple(tokens), salt=salt)


def test_pins_survive_lru_pressure_and_yield_to_real_demand():
    kv = KvCore(KvConfig(num_blocks=8, block_size=BS))
    prompt = list(range(9))  # two full blocks + one token
    run(kv, alloc("a", prompt))
    r = run(kv, free("a", prompt), pin("session:s", prompt))
    assert (r.figures.pinned, r.figures.used, r.figures.free) == (2, 2, 6)
    # six other blocks cycle through the LRU: the pinned prefix is never evicted
    for i in range(3):
        other = list(range(100 * (i + 1), 100 * (i + 1) + 8))
        run(kv, alloc(f"o{i}", other))
        run(kv, free(f"o{i}", other))
    r = run(kv, alloc("b", prompt))
    assert r.results[0].cached_tokens == 8  # the pinned blocks were reused
    run(kv, free("b", prompt[8:]))  # only the last token was computed
    # a request needing the whole pool makes the pin yield rather than wait forever
    r = run(kv, alloc("big", list(range(500, 532))))
    assert r.results[0].ok and r.figures.pinned == 0 and kv.pins == {}
    run(kv, free("big"))
    r = run(kv, KvOp("unpin", "session:s"))  # unpinning a dropped pin is harmless
    assert r.figures.used == 0


def test_pins_never_exceed_half_the_pool():
    kv = KvCore(KvConfig(num_blocks=8, block_size=BS))
    for i in range(4):
        p = list(range(100 * i, 100 * i + 8))
        run(kv, alloc(f"a{i}", p))
        run(kv, free(f"a{i}", p), pin(f"prompt:{i}", p))
    assert kv.figures().pinned <= 4 and list(kv.pins) == ["prompt:2", "prompt:3"]  # oldest dropped


def test_forget_drops_the_cache_and_the_pins_after_a_suspend():
    from imp.messages import KvForget

    kv = KvCore(KvConfig(8, BS, "m"))
    prompt = list(range(8))
    run(kv, alloc("a", prompt), KvOp("pin", "session", token_ids=tuple(prompt)))
    run(kv, free("a", prompt), KvOp("pin", "session", token_ids=tuple(prompt)))
    assert run(kv, alloc("b", prompt)).results[0].cached_tokens == 4  # warm before
    run(kv, free("b"))
    assert kv.handle("ingress", KvForget()) == []
    kv.audit()
    f = kv.figures()
    assert (f.free, f.cached, f.pinned) == (8, 0, 0)
    assert run(kv, alloc("c", prompt)).results[0].cached_tokens == 0  # the released pool promises nothing


def _swap_run(kv: KvCore, *ops: KvOp):
    """(executor messages, reply) of one request."""
    out = kv.handle("scheduler", KvRequest(1, tuple(ops)))
    kv.audit()
    assert out[-1][0] == "scheduler"
    return [m for r, m in out[:-1] if r == "executor"], out[-1][1]


def test_swap_out_parks_the_written_blocks_and_swap_in_copies_back_only_what_the_cache_lost():
    from imp.messages import KvSwapIn, KvSwapOut

    kv = KvCore(KvConfig(num_blocks=8, block_size=BS, swap_blocks=6))
    tokens = list(range(11))  # blocks: [0..3] [4..7] [8..10 + room]
    _, r = _swap_run(kv, alloc("a", tokens, num=12))
    table = r.results[0].block_table
    msgs, r = _swap_run(kv, KvOp("swap_out", "a", 10, tuple(tokens[:10])))  # positions 0..9 written
    assert msgs == [KvSwapOut(table, (0, 1, 2))] and r.results == ()
    assert (r.figures.used, r.figures.swap_used, r.figures.swaps_out, r.figures.cached) == (0, 3, 1, 2)
    # the pool reused by another sequence: one of a's two cached full blocks is evicted
    _, r = _swap_run(kv, alloc("b", [50 + i for i in range(28)]))
    assert r.results[0].ok and r.figures.evictions == 1
    msgs, r = _swap_run(kv, free("b"), KvOp("swap_in", "a", 12, tuple(tokens)))
    res = r.results[0]
    assert res.ok and res.cached_tokens == 10 and len(res.block_table) == 3
    # the oldest-released block (a's tail full block [4..7]) went to b; the head block [0..3] is still cached
    assert res.block_table[0] == table[0]
    assert msgs == [KvSwapIn((1, 2), res.block_table[1:])]
    assert (r.figures.swap_used, r.figures.swaps_in, r.figures.cached) == (0, 1, 2)  # [4..7] cached again


def test_a_swap_in_without_room_stays_parked_and_unswap_frees_the_slots():
    kv = KvCore(KvConfig(num_blocks=4, block_size=BS, swap_blocks=4))
    _swap_run(kv, alloc("a", range(8), num=8))
    _swap_run(kv, KvOp("swap_out", "a", 7, tuple(range(7))))
    _swap_run(kv, alloc("b", range(100, 116), num=16))  # the whole pool
    msgs, r = _swap_run(kv, KvOp("swap_in", "a", 8, tuple(range(8))))
    assert not r.results[0].ok and msgs == [] and r.figures.swap_used == 2 and "a" in kv.swapped
    _, r = _swap_run(kv, KvOp("unswap", "a"))
    assert r.figures.swap_used == 0 and not kv.swapped
    _swap_run(kv, KvOp("unswap", "a"))  # again (a swap_in landed before the end was known): nothing happens
    with pytest.raises(CoreError):
        kv.handle("scheduler", KvRequest(1, (KvOp("swap_in", "a", 8, tuple(range(8))),)))
