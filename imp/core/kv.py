"""KV block allocator: paged blocks, refcounts and a prefix cache.

The pool is `num_blocks` blocks of `block_size` positions. A sequence owns a
block table (block ids in position order); blocks shared between sequences
(a cached prompt prefix, or the prompt of n > 1 siblings) carry a refcount.
Only full blocks are ever shared, so the block a sequence writes to is its
own: no copy-on-write is needed.

Prefix cache: a full block whose tokens have been *written* (the scheduler
reports written tokens in each op's token_ids) is keyed by a chained SHA-256
of its token ids, salted with the model fingerprint and the op's salt (the
LoRA adapter name; different adapters never share KV). A block is hashed only
once its step has run, so an alloc never reuses a block whose KV is still
being computed. Freed hashed blocks stay in the cache at refcount 0, in LRU
order, and are evicted (oldest release first) only when no clean block is
left. Free blocks, for the figures, include those evictable cached ones.

Blocks in flight (`KvConfig.share_in_flight`): an alloc also hashes its prompt's
full blocks past the cache hits and records them as promised by that sequence
until it writes them (or is freed). A later alloc whose first missing block is
promised by another live sequence is refused with `wait` (KvResult.wait): the
scheduler keeps it waiting, and a later round finds those blocks cached, instead
of computing the same prompt twice side by side (a burst of requests sharing a
system prompt, or n identical ones, arriving together). A wait is no shortage:
the ops behind it still run.

Ops in one KvRequest apply in order. Once an op fails for want of blocks,
every later op of the request that needs a new block fails too: the
scheduler lists decodes before admissions and admissions in priority order,
so a smaller request behind a failed one never jumps the queue.

Tiers (`KvConfig.tier_blocks` > 0: --prompt-cache-dir, --host-cache-gb): every block that becomes a cache
entry is also written to the tier (KvSave to the executor, which gets it before any step that could write
over the block), up to tier_blocks keys, least recently used dropped first (KvDrop). With
`tier_demote` (a host tier and no disk: nothing has to outlive the process) a block is written only when the
pool evicts it instead, so the tier costs a copy only under pressure. An alloc whose chain
goes on past the pool's hits into keys the tier holds takes blocks for them, asks the executor to fill
them (KvLoad) and waits (KvResult.wait); each KvLoaded makes its block a cache entry (or, not ok, frees
it and forgets the key), and KvReady (once none is left in flight) tells the scheduler to try again: the retry finds them
as hits. A
load is never counted before the executor says it landed, so a missing or corrupt file costs a
recompute, never a wrong token. The tier's keys at boot come in a KvStored (on the log: replay needs
no disk).

Swap (`KvConfig.swap_blocks` > 0): "swap_out" parks a preempted sequence's KV in the executor's swap area
(host memory; KvSwapOut, ahead of the step this reply plans, so the copy precedes anything written over
the blocks) and releases its blocks as "free" does (its full blocks stay cache entries); "swap_in" takes
blocks again, shares the leading full blocks still cached and copies the rest back (KvSwapIn), so the
sequence goes on from where it was instead of computing its context again. Which preemption swaps is the
scheduler's decision (its cost model, imp.core.lifecycle); the allocator only keeps the slots.

Pins (`cache_prompt`, `session_id`): op "pin" holds the cached full blocks of
a token list under a key (one refcount each, like a sequence would), so they
are not evicted by the LRU; "unpin" releases them; pinning a key again
replaces its old pin. Pins never take more than half the pool, and when an
op cannot get its blocks otherwise, the oldest pins are dropped first: a pin
is a cache priority, never a reservation that could deadlock the queue.
"""

from __future__ import annotations

import collections
import hashlib
import struct

import msgspec

from imp.core.core import CoreError, Out
from imp.messages import (KvDrop, KvFigures, KvForget, KvLoad, KvLoaded, KvOp, KvReady, KvReply, KvRequest, KvResult,
                          KvSave, KvStored, KvSwapIn, KvSwapOut, Msg)


TIER_ROUNDS = 2  # rounds of tier loads one alloc may start before it computes what is still missing


class KvConfig(msgspec.Struct, frozen=True):
    num_blocks: int
    block_size: int = 16
    fingerprint: str = ""  # model identity: a cache entry never outlives its model
    # an alloc waits for prompt blocks another sequence is computing (see the module doc); False = the
    # allocator before this field (logs written then replay identically)
    share_in_flight: bool = False
    # > 0: the prefix cache's disk tier holds up to this many blocks (see the module doc); 0 = none (the
    # allocator before this field: logs written then replay identically)
    tier_blocks: int = 0
    # True: blocks go to the tier as the pool evicts them, not as they become cache entries (see the module doc)
    tier_demote: bool = False
    # > 0: the executor's swap area holds this many blocks of parked sequences (see the module doc); 0 = none
    swap_blocks: int = 0

    def __post_init__(self):
        if self.num_blocks < 1 or self.block_size < 1 or self.tier_blocks < 0 or self.swap_blocks < 0:
            raise ValueError(f"bad KvConfig {self}")


class _Seq:
    """A sequence's table and the state of its hash chain."""

    __slots__ = ("last_hash", "n_hashed", "pending", "promises", "salt", "table")

    def __init__(self, table: list[int], salt: str, n_hashed: int, last_hash: bytes):
        self.table = table
        self.salt = salt
        self.n_hashed = n_hashed  # leading blocks whose written content is hashed
        self.last_hash = last_hash  # chain hash of block n_hashed-1 (root if none)
        self.pending: list[int] = []  # written tokens of block n_hashed, not yet full
        self.promises: list[bytes] = []  # chain hashes of its prompt blocks it will write (share_in_flight)


class KvCore:
    name = "kv"

    def __init__(self, config: KvConfig):
        self.config = config
        n = config.num_blocks
        self.refcount = [0] * n
        self.block_hash: list[bytes | None] = [None] * n  # set while the block is the cache entry
        self.clean: collections.deque[int] = collections.deque(range(n))  # refcount 0, unhashed
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # refcount 0, hashed
        self.cache: dict[bytes, int] = {}  # chain hash -> block id
        self.seqs: dict[str, _Seq] = {}
        self.evictions = 0
        self.pins: dict[str, list[int]] = {}  # key -> held blocks, oldest pin first
        self.promised: dict[bytes, str] = {}  # chain hash -> the live sequence computing that block
        self.waits = 0  # allocs refused because their next block was being computed
        self._dry = False  # an op of the current request failed for want of blocks
        self.stored: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # tier keys, LRU first
        self.loading: dict[bytes, int] = {}  # tier key -> the block being filled (held: refcount 1)
        self.stale: set[bytes] = set()  # loads begun before a KvForget: what lands is not the pool's
        self.tier_saves = self.tier_loads = self.tier_hits = self.tier_misses = self.tier_drops = 0
        self.tier_host_hits = 0
        # rounds of tier loads an alloc started: a pool too small for the whole chain evicted what one round
        # loaded to load the next (a livelock the scheduler machine found); after TIER_ROUNDS it computes
        self.tier_rounds: dict[str, int] = {}
        self._out: Out = []  # tier messages of the current handling
        self.swap_free: collections.deque[int] = collections.deque(range(config.swap_blocks))
        self.swapped: dict[str, tuple[list[int], int]] = {}  # parked sequence -> (its slots, positions parked)
        self.swaps_out = self.swaps_in = self.swap_copies = 0

    # ------------------------------------------------------------------ core

    def handle(self, sender: str, msg: Msg) -> Out:
        self._out = []
        if isinstance(msg, KvForget):
            self._forget()
            return []
        if isinstance(msg, KvStored):
            self.stored = collections.OrderedDict.fromkeys(msg.keys)
            self._trim()
            return self._out
        if isinstance(msg, KvLoaded):
            self._loaded(msg)
            # once the last load in flight landed: a retry per block walked the whole chain each time
            # (a 1,211-block prompt: 1.5 M hashes, a second of a restart's TTFT)
            return [*self._out, ("scheduler", KvReady())] if not self.loading else self._out
        if not isinstance(msg, KvRequest):
            raise CoreError(f"kv cannot handle {type(msg).__name__}")
        self._dry = False
        results = []
        for op in msg.ops:
            fn = {"alloc": self._alloc, "grow": self._grow, "fork": self._fork, "free": self._free,
                  "pin": self._pin, "unpin": self._unpin, "swap_out": self._swap_out, "swap_in": self._swap_in,
                  "unswap": self._unswap}.get(op.kind)
            if fn is None:
                raise CoreError(f"unknown kv op {op.kind!r}")
            r = fn(op)
            if r is not None:
                results.append(r)
        # the tier's writes and reads first: the executor must have them before the step this reply plans
        return [*self._out, ("scheduler", KvReply(msg.step, tuple(results), self.figures()))]

    def figures(self) -> KvFigures:
        free = len(self.clean) + len(self.lru)
        n = self.config.num_blocks
        return KvFigures(
            total=n, free=free, used=n - free, reserved=0, cached=len(self.cache),
            block_size=self.config.block_size, evictions=self.evictions, inflight_waits=self.waits,
            pinned=len(set().union(*self.pins.values())) if self.pins else 0,  # distinct blocks
            tier_blocks=len(self.stored), tier_saves=self.tier_saves, tier_loads=self.tier_loads,
            tier_hits=self.tier_hits, tier_misses=self.tier_misses, tier_drops=self.tier_drops,
            tier_host_hits=self.tier_host_hits,
            swap_blocks=self.config.swap_blocks, swap_used=self.config.swap_blocks - len(self.swap_free),
            swaps_out=self.swaps_out, swaps_in=self.swaps_in, swap_copies=self.swap_copies,
        )

    def audit(self) -> None:
        """Assert the allocator's invariants (tests call this after every step)."""
        holders = [0] * self.config.num_blocks
        for s in self.seqs.values():
            assert len(set(s.table)) == len(s.table), "a table holds a block twice"
            for b in s.table:
                holders[b] += 1
        for blocks in self.pins.values():
            assert len(set(blocks)) == len(blocks), "a pin holds a block twice"
            for b in blocks:
                holders[b] += 1
        for b in self.loading.values():  # the tier holds a block it is filling
            holders[b] += 1
        assert sum(len(b) for b in self.pins.values()) <= self.config.num_blocks // 2
        assert holders == self.refcount, "refcounts differ from holders"
        idle = list(self.clean) + list(self.lru)
        assert len(set(idle)) == len(idle)
        assert sorted(b for b in range(len(holders)) if holders[b] == 0) == sorted(idle)
        assert all(self.block_hash[b] is None for b in self.clean)
        assert all(self.block_hash[b] is not None for b in self.lru)
        promised = {h: sid for sid, s in self.seqs.items() for h in s.promises}
        assert promised == self.promised, "promises differ from the sequences that hold them"
        assert not (promised.keys() & self.cache.keys()), "a cached block is still promised"
        slots = [x for sl, _ in self.swapped.values() for x in sl] + list(self.swap_free)
        assert sorted(slots) == list(range(self.config.swap_blocks)), "swap slots lost or held twice"
        assert not (self.swapped.keys() & self.seqs.keys()), "a sequence both parked and in the pool"
        assert {self.cache[h]: h for h in self.cache} == {
            b: h for b, h in enumerate(self.block_hash) if h is not None
        }

    # ------------------------------------------------------------------ ops

    def _alloc(self, op: KvOp) -> KvResult:
        if op.seq_id in self.seqs:
            raise CoreError(f"alloc of live sequence {op.seq_id}")
        bs = self.config.block_size
        # Longest cached chain of full prompt blocks, never the block holding
        # the last known token: its logits must be computed to sample.
        hits, last = self._cached_chain(op.token_ids, op.salt,
                                        min((len(op.token_ids) - 1) // bs, self._blocks(op.num_tokens)))
        if self.config.tier_blocks and self.tier_rounds.get(op.seq_id, 0) < TIER_ROUNDS and self._from_tier(
                op, last, len(hits)):
            return KvResult(op.seq_id, False, wait=True, loading=True)  # blocks on their way from the tier
        promises: list[bytes] = []
        if self.config.share_in_flight:
            hp = last
            for i in range(len(hits), (len(op.token_ids) - 1) // bs):  # the blocks it would compute
                hp = self._chain(hp, op.token_ids[i * bs : (i + 1) * bs])
                if not promises and self.promised.get(hp, op.seq_id) != op.seq_id:
                    self.waits += 1
                    return KvResult(op.seq_id, False, wait=True)  # another sequence is writing it now
                if hp not in self.promised and hp not in self.cache:  # (a later block may be cached already)
                    promises.append(hp)
        table = self._claim(hits, self._blocks(op.num_tokens) - len(hits))
        if table is None:
            return KvResult(op.seq_id, False)
        s = self.seqs[op.seq_id] = _Seq(table, op.salt, len(hits), last)
        s.promises = promises
        for hp in promises:
            self.promised[hp] = op.seq_id
        self.tier_rounds.pop(op.seq_id, None)
        return KvResult(op.seq_id, True, tuple(table), cached_tokens=len(hits) * bs)

    def _fork(self, op: KvOp) -> KvResult:
        """Share the parent's full blocks of the first num_tokens positions
        (leaving the last token to compute) and give the child its own tail."""
        if op.seq_id in self.seqs or op.parent not in self.seqs:
            raise CoreError(f"bad fork {op.parent} -> {op.seq_id}")
        bs = self.config.block_size
        k = (op.num_tokens - 1) // bs
        parent = self.seqs[op.parent]
        assert k <= len(parent.table), "fork beyond the parent's table"
        need = self._blocks(op.num_tokens) - k
        if not self._can_take(need, parent.table[:k]):
            return KvResult(op.seq_id, False)
        h = self._root(op.salt)
        for i in range(k):
            h = self._chain(h, op.token_ids[i * bs : (i + 1) * bs])
        for b in parent.table[:k]:
            self._hold(b)
        table = parent.table[:k] + [self._take() for _ in range(need)]
        self.seqs[op.seq_id] = _Seq(table, op.salt, k, h)
        return KvResult(op.seq_id, True, tuple(table), cached_tokens=k * bs)

    def _grow(self, op: KvOp) -> KvResult:
        s = self._seq(op)
        self._written(s, op.token_ids)  # facts about the past: recorded even if the grow fails
        need = self._blocks(op.num_tokens) - len(s.table)
        if need > 0:
            if not self._can_take(need):
                return KvResult(op.seq_id, False)
            s.table.extend(self._take() for _ in range(need))
        return KvResult(op.seq_id, True, tuple(s.table))

    def _free(self, op: KvOp) -> None:
        s = self._seq(op)
        self._written(s, op.token_ids)
        self._unpromise(s, op.seq_id)
        del self.seqs[op.seq_id]
        for b in reversed(s.table):  # tail first: a prefix's head outlives its tail in the LRU
            self._release(b)

    def _swap_out(self, op: KvOp) -> None:
        """Park the KV of the sequence's first op.num_tokens positions in the swap area, then free it."""
        s = self._seq(op)
        n = self._blocks(op.num_tokens)
        if op.seq_id in self.swapped or not 0 < n <= len(s.table) or n > len(self.swap_free):
            raise CoreError(f"bad swap_out of {op.seq_id}: {n} blocks, {len(self.swap_free)} slots free")
        slots = [self.swap_free.popleft() for _ in range(n)]
        self.swap_copies += n
        self._out.append(("executor", KvSwapOut(tuple(s.table[:n]), tuple(slots))))  # before the blocks go
        self.swapped[op.seq_id] = (slots, op.num_tokens)
        self.swaps_out += 1
        self._free(op)

    def _swap_in(self, op: KvOp) -> KvResult:
        """A table for op.num_tokens positions with the parked ones back: cached leading blocks shared, the
        rest copied from the swap area. Refused (still parked) when the blocks are not there."""
        if op.seq_id in self.seqs or op.seq_id not in self.swapped:
            raise CoreError(f"swap_in of {op.seq_id}: not parked")
        slots, kept = self.swapped[op.seq_id]
        bs = self.config.block_size
        hits, last = self._cached_chain(op.token_ids, op.salt, kept // bs)
        table = self._claim(hits, self._blocks(op.num_tokens) - len(hits))
        if table is None:
            return KvResult(op.seq_id, False)
        back = range(len(hits), len(slots))
        self.swap_copies += len(back)
        if back:
            self._out.append(("executor", KvSwapIn(tuple(slots[i] for i in back), tuple(table[i] for i in back))))
        del self.swapped[op.seq_id]
        self.swap_free.extend(slots)
        self.swaps_in += 1
        s = self.seqs[op.seq_id] = _Seq(table, op.salt, len(hits), last)
        self._written(s, list(op.token_ids[len(hits) * bs : kept]))  # its copied blocks are cache entries again
        return KvResult(op.seq_id, True, tuple(table), cached_tokens=kept)

    def _unswap(self, op: KvOp) -> None:
        """A parked sequence ended: its slots are free (what they hold is never read)."""
        parked = self.swapped.pop(op.seq_id, None)
        if parked is not None:
            self.swap_free.extend(parked[0])

    def _pin(self, op: KvOp) -> None:
        """Hold the cached full blocks of op.token_ids under the key op.seq_id."""
        self._unpin(op)
        blocks, _ = self._cached_chain(op.token_ids, op.salt, len(op.token_ids) // self.config.block_size)
        cap = self.config.num_blocks // 2
        blocks = blocks[:cap]
        while self.pins and sum(len(v) for v in self.pins.values()) + len(blocks) > cap:
            for b in self.pins.pop(next(iter(self.pins))):  # the oldest pin goes first
                self._release(b)
        for b in blocks:
            self._hold(b)
        if blocks:
            self.pins[op.seq_id] = blocks

    def _forget(self) -> None:
        """The pool was released (suspend): no cached block holds its KV any more. Sent after a
        drain; a sequence still live here (its free not yet applied) keeps its table, but none
        of its blocks stays a cache entry."""
        for key in list(self.pins):
            for b in self.pins.pop(key):
                self._release(b)
        for b in self.lru:
            self.clean.append(b)
        self.lru.clear()
        self.block_hash = [None] * self.config.num_blocks
        self.cache.clear()
        for sid, s in self.seqs.items():  # what they write now is not worth waiting for: none will be cached
            self._unpromise(s, sid)
        self.stale |= self.loading.keys()  # the tier's files stay; loads into the released pool do not count

    def _unpin(self, op: KvOp) -> None:
        for b in self.pins.pop(op.seq_id, []):
            self._release(b)

    # ------------------------------------------------------------------ blocks

    def _written(self, s: _Seq, tokens: list[int]) -> None:
        """Record tokens whose KV is now in place; cache blocks that filled up."""
        bs = self.config.block_size
        s.pending.extend(tokens)
        while len(s.pending) >= bs:
            assert s.n_hashed < len(s.table), "written past the table"
            h = self._chain(s.last_hash, s.pending[:bs])
            b = s.table[s.n_hashed]
            if h not in self.cache:  # else the same content was computed twice: keep the first
                assert self.block_hash[b] is None
                self.cache[h] = b
                self.block_hash[b] = h
                if self.config.tier_blocks and not self.config.tier_demote:
                    self._to_tier(h, b)
            s.last_hash, s.n_hashed, s.pending = h, s.n_hashed + 1, s.pending[bs:]
            owner = self.promised.pop(h, None)  # a promised block is written (by its promiser, or by a fork
            if owner is not None:  # child sharing the chain): the cache has it now, nobody waits for it
                self.seqs[owner].promises.remove(h)

    def warm(self, token_ids, salt: str = "") -> tuple[int, int, int]:
        """A read-only question, not a decision (no state changes): of the prompt's blocks an alloc could take
        from the cache (its full blocks but the one holding its last token), (how many lead the chain in the
        pool, how many more continue it on the disk tier, how many there are)."""
        bs, h = self.config.block_size, self._root(salt)
        n = (len(token_ids) - 1) // bs
        pool = disk = 0
        for i in range(n):
            h = self._chain(h, token_ids[i * bs : (i + 1) * bs])
            if not disk and (h in self.cache or h in self.loading):
                pool += 1
            elif h in self.stored:
                disk += 1
            else:
                break
        return pool, disk, n

    # ------------------------------------------------------------------ the disk tier

    def _to_tier(self, h: bytes, b: int) -> None:
        """A new cache entry: written through to the tier (once per key)."""
        if h in self.stored:
            self.stored.move_to_end(h)
            return
        self.stored[h] = None
        self.tier_saves += 1
        self._out.append(("executor", KvSave(b, h)))
        self._trim()

    def _trim(self) -> None:
        while len(self.stored) > self.config.tier_blocks:
            k, _ = self.stored.popitem(last=False)
            self.tier_drops += 1
            self._out.append(("executor", KvDrop(k)))

    def _from_tier(self, op: KvOp, h: bytes, start: int) -> bool:
        """After `start` pool hits (chain at h): the tier's blocks that continue the chain, asked for. True
        when the alloc must wait for them (asked now, or already on their way)."""
        bs, want = self.config.block_size, []
        for i in range(start, min((len(op.token_ids) - 1) // bs, self._blocks(op.num_tokens))):
            h = self._chain(h, op.token_ids[i * bs : (i + 1) * bs])
            if h in self.cache:
                continue  # computed since (another sequence): a hit on the retry
            if h in self.loading:
                return True
            if h not in self.stored:
                break
            want.append(h)
        dry = self._dry
        if not want or not self._can_take(len(want)):
            self._dry = dry  # no room to load into: it computes them instead (no shortage of its own)
            return False
        for k in want:  # the chain being read is the tier's newest (a demoting take below may trim the tier:
            self.stored.move_to_end(k)  # a key of it dropped all the same loads nothing, and is computed)
        for k in want:
            b = self._take()
            self.loading[k] = b
            self.tier_loads += 1
            self._out.append(("executor", KvLoad(b, k)))
        self.waits += 1
        self.tier_rounds[op.seq_id] = self.tier_rounds.pop(op.seq_id, 0) + 1
        while len(self.tier_rounds) > 4096:  # (a sequence that never allocates again: cancelled while waiting)
            self.tier_rounds.pop(next(iter(self.tier_rounds)))
        return True

    def _loaded(self, m: KvLoaded) -> None:
        b = self.loading.pop(m.key, None)
        if b is None or b != m.block:
            raise CoreError(f"KvLoaded for a block not being loaded: {m.block}")
        if m.ok and m.key not in self.stale and m.key not in self.cache:
            self.cache[m.key] = b
            self.block_hash[b] = m.key
            self.tier_hits += 1
            self.tier_host_hits += m.source == "host"
            # a sequence that gave up waiting for the tier (TIER_ROUNDS) may have promised to compute this block
            # meanwhile: the cache has it now, nobody need wait for that (as when a promised block is written)
            owner = self.promised.pop(m.key, None)
            if owner is not None:
                self.seqs[owner].promises.remove(m.key)
        elif not m.ok:
            self.stored.pop(m.key, None)  # missing, corrupt or foreign: computed next time, and written again
            self.tier_misses += 1
        self.stale.discard(m.key)
        self._release(b)

    def _unpromise(self, s: _Seq, seq_id: str) -> None:
        for h in s.promises:
            if self.promised.get(h) == seq_id:
                del self.promised[h]
        s.promises = []

    def _cached_chain(self, token_ids, salt: str, n: int) -> tuple[list[int], bytes]:
        """The cached blocks that lead token_ids' chain (at most n), and the chain hash after the last of them."""
        bs = self.config.block_size
        h = last = self._root(salt)
        hits: list[int] = []
        for i in range(n):
            h = self._chain(h, token_ids[i * bs : (i + 1) * bs])
            if h not in self.cache:
                break
            hits.append(self.cache[h])
            last = h
        return hits, last

    def _claim(self, hits: list[int], need: int) -> list[int] | None:
        """A table: the cached `hits` held, then `need` blocks taken; None when the pool cannot give them."""
        if not self._can_take(need, hits):
            return None
        for b in hits:
            self._hold(b)
        return hits + [self._take() for _ in range(need)]

    def _can_take(self, need: int, keep: list[int] | tuple = ()) -> bool:
        """Can `need` new blocks be taken, besides the blocks in `keep` (held next)?"""
        while need > 0:
            revived = sum(1 for b in keep if self.refcount[b] == 0)  # they leave the LRU
            if not self._dry and need <= len(self.clean) + len(self.lru) - revived:
                return True
            if self._dry or not self.pins:
                self._dry = True
                return False
            for b in self.pins.pop(next(iter(self.pins))):  # the oldest pin yields
                self._release(b)
        return True

    def _take(self) -> int:
        if self.clean:
            b = self.clean.popleft()
        else:
            b, _ = self.lru.popitem(last=False)
            if self.config.tier_demote:  # its KV to the tier before the step this reply plans writes over it
                self._to_tier(self.block_hash[b], b)
            del self.cache[self.block_hash[b]]
            self.block_hash[b] = None
            self.evictions += 1
        assert self.refcount[b] == 0
        self.refcount[b] = 1
        return b

    def _hold(self, b: int) -> None:
        if self.refcount[b] == 0:
            del self.lru[b]
        self.refcount[b] += 1

    def _release(self, b: int) -> None:
        assert self.refcount[b] > 0
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            if self.block_hash[b] is None:
                self.clean.append(b)
            else:
                self.lru[b] = None

    def _seq(self, op: KvOp) -> _Seq:
        s = self.seqs.get(op.seq_id)
        if s is None:
            raise CoreError(f"{op.kind} of unknown sequence {op.seq_id}")
        return s

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _root(self, salt: str) -> bytes:
        return hashlib.sha256(f"{self.config.fingerprint}\0{salt}".encode()).digest()

    @staticmethod
    def _chain(prev: bytes, tokens: list[int]) -> bytes:
        return hashlib.sha256(prev + struct.pack(f"<{len(tokens)}q", *tokens)).digest()
