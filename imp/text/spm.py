"""SentencePiece-style encoding (llama.cpp's `llama` vocabulary type: Gemma, Llama 2) in Numba,
over a few sorted arrays.

Why not HF `tokenizers` any more: the BPE it needs for a SentencePiece vocabulary has one merge
per way of cutting each token in two (Gemma 3: 515 k merges for 262 k tokens), which it held in
~160 MB of resident memory and took 2 s to build (issue 15 §4). Here the merges are three
arrays (~8 MB for Gemma) and the merge loop runs in Numba without the GIL.

The rules are the ones that engine applied, so the ids are the same (tests/test_spm.py holds the
two to each other):
- text is normalized piece by piece: "▁" in front (`add_space_prefix`), every " " as "▁";
  user-defined tokens are matched whole first (leftmost-longest) and cut the text into pieces;
- each character is its token, or else its UTF-8 bytes as `<0xNN>` tokens (byte fallback), or
  else the unknown token (runs of unknowns fused into one);
- then, repeatedly, the adjacent pair with the lowest merge rank is merged (leftmost first on
  a tie). A merge joins two tokens whose texts concatenate to a NORMAL or USER_DEFINED token;
  merges rank by that token's score (best first), then its id, then the left part's id. That
  is llama.cpp's "best-scored bigram first" with a deterministic order among equal scores.
"""

from __future__ import annotations

import re

import numpy as np
from numba import njit

_SPACE = "\u2581"


class SpmEngine:
    """ids of one normalized piece at a time (`encode`); thread-safe (read-only arrays)."""

    def __init__(self, tokens: list[str], scores: list[float], add_space_prefix: bool, unk_id: int | None,
                 mergeable: set[int], user_defined: list[int]):
        """mergeable: the ids a merge may produce (llama.cpp's NORMAL and USER_DEFINED tokens of two
        or more characters); user_defined: ids matched whole in raw text."""
        n = self.n = len(tokens)
        first: dict[str, int] = {}
        for i, t in enumerate(tokens):
            first.setdefault(t, i)  # a text's id is its first (HF's vocab: first id wins)
        singles = sorted((ord(t), i) for t, i in first.items() if len(t) == 1)
        self.cps = np.array([c for c, _ in singles], dtype=np.int64)
        self.cp_ids = np.array([i for _, i in singles], dtype=np.int64)
        self.byte_ids = np.full(256, -1, dtype=np.int64)
        for b in range(256):
            self.byte_ids[b] = first.get(f"<0x{b:02X}>", -1)
        self.unk = -1 if unk_id is None else int(unk_id)
        self.keys, self.ranks, self.new_by_rank = _merges(tokens, scores, first, mergeable, n)
        self.prefix = _SPACE if add_space_prefix else ""
        users = sorted({tokens[i] for i in user_defined if tokens[i]}, key=len, reverse=True)
        self._user = re.compile("|".join(map(re.escape, users))) if users else None
        self._user_id = {t: first[t] for t in users}
        self.encode("warm up")  # Numba's cached machine code loads at the first call: at boot, not a request

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no BOS; no special-token parsing)."""
        if not text:
            return []
        if self._user is None:
            return self._piece(text)
        out: list[int] = []
        pos = 0
        for m in self._user.finditer(text):
            if m.start() > pos:
                out += self._piece(text[pos:m.start()])
            out.append(self._user_id[m.group()])
            pos = m.end()
        if pos < len(text):
            out += self._piece(text[pos:])
        return out

    def _piece(self, text: str) -> list[int]:
        norm = self.prefix + text.replace(" ", _SPACE)
        cps = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)
        return _bpe(cps, self.cps, self.cp_ids, self.byte_ids, self.unk, self.keys, self.ranks, self.new_by_rank,
                    self.n).tolist()


def _merges(tokens: list[str], scores: list[float], first: dict[str, int], mergeable: set[int], n: int):
    """(pair keys a * n + b sorted, their ranks, the new id of each rank): one merge per way of cutting
    a mergeable token's text into two vocabulary texts, ranked by (-score, id, left id). A pair
    listed twice (two tokens of one text) keeps its last rank, as a map built from the list would."""
    import array

    a_ids, b_ids, new_ids, order_s, order_i = (array.array("q") for _ in range(5))
    sc = np.asarray(scores, dtype=np.float64)
    for i in sorted(mergeable):
        t = tokens[i]
        for k in range(1, len(t)):
            a = first.get(t[:k])
            if a is None:
                continue
            b = first.get(t[k:])
            if b is not None:
                a_ids.append(a)
                b_ids.append(b)
                new_ids.append(first[t])
                order_i.append(i)
    a_ids, b_ids, new_ids, order_i = (np.frombuffer(x, dtype=np.int64) if len(x) else np.zeros(0, np.int64)
                                      for x in (a_ids, b_ids, new_ids, order_i))
    rank_order = np.lexsort((a_ids, order_i, -sc[order_i]))  # by -score, then id, then left id
    keys = a_ids[rank_order] * n + b_ids[rank_order]
    new_by_rank = new_ids[rank_order]
    # a key listed twice: the last (highest) rank wins; a stable sort keeps rank order within a key
    by_key = np.argsort(keys, kind="stable")
    k_sorted = keys[by_key]
    last = np.ones(len(k_sorted), dtype=bool)
    last[:-1] = k_sorted[1:] != k_sorted[:-1]
    # ranks and ids fit int32 (half of Gemma 3's 12 MB of tables); keys a * n + b do not
    return k_sorted[last].copy(), by_key[last].astype(np.int32), new_by_rank.astype(np.int32)


@njit(cache=True, nogil=True)
def _lookup(keys, ranks, a, b, n):
    """The rank of merging (a, b), or -1."""
    k = a * n + b
    j = np.searchsorted(keys, k)
    if j < keys.size and keys[j] == k:
        return np.int64(ranks[j])
    return -1


@njit(cache=True, nogil=True)
def _push(heap, size, item):
    heap[size] = item
    i = size
    while i > 0:
        p = (i - 1) >> 1
        if heap[p] <= heap[i]:
            break
        heap[p], heap[i] = heap[i], heap[p]
        i = p
    return size + 1


@njit(cache=True, nogil=True)
def _pop(heap, size):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and heap[c + 1] < heap[c]:
            c += 1
        if heap[i] <= heap[c]:
            break
        heap[i], heap[c] = heap[c], heap[i]
        i = c
    return top, size


@njit(cache=True, nogil=True)
def _bpe(cps, cp_keys, cp_ids, byte_ids, unk, keys, ranks, new_by_rank, n):
    # symbols: one per character, or one per UTF-8 byte of a character without a token
    m = cps.size
    ids = np.empty(4 * m + 1, dtype=np.int64)
    s = 0
    buf = np.empty(4, dtype=np.int64)
    for c in cps:
        j = np.searchsorted(cp_keys, c)
        if j < cp_keys.size and cp_keys[j] == c:
            ids[s] = cp_ids[j]
            s += 1
            continue
        nb = 1 if c < 0x80 else 2 if c < 0x800 else 3 if c < 0x10000 else 4
        if nb == 1:
            buf[0] = c
        elif nb == 2:
            buf[0], buf[1] = 0xC0 | (c >> 6), 0x80 | (c & 0x3F)
        elif nb == 3:
            buf[0], buf[1], buf[2] = 0xE0 | (c >> 12), 0x80 | ((c >> 6) & 0x3F), 0x80 | (c & 0x3F)
        else:
            buf[0], buf[1] = 0xF0 | (c >> 18), 0x80 | ((c >> 12) & 0x3F)
            buf[2], buf[3] = 0x80 | ((c >> 6) & 0x3F), 0x80 | (c & 0x3F)
        ok = True
        for q in range(nb):
            if byte_ids[buf[q]] < 0:
                ok = False
        if ok:
            for q in range(nb):
                ids[s] = byte_ids[buf[q]]
                s += 1
        elif unk >= 0 and not (s > 0 and ids[s - 1] == unk):  # runs of unknowns fuse into one
            ids[s] = unk
            s += 1
    nxt = np.empty(s, dtype=np.int64)
    prv = np.empty(s, dtype=np.int64)
    alive = np.ones(s, dtype=np.bool_)
    for i in range(s):
        nxt[i] = i + 1 if i + 1 < s else -1
        prv[i] = i - 1
    # heap of rank << 32 | left position: the lowest rank first, then the leftmost
    heap = np.empty(3 * s + 2, dtype=np.int64)  # s - 1 pairs, then at most 2 pushes a merge
    size = 0
    for i in range(s - 1):
        r = _lookup(keys, ranks, ids[i], ids[i + 1], n)
        if r >= 0:
            size = _push(heap, size, (r << 32) | i)
    while size > 0:
        top, size = _pop(heap, size)
        r, left = top >> 32, top & 0xFFFFFFFF
        if not alive[left] or nxt[left] < 0:
            continue
        right = nxt[left]
        now = _lookup(keys, ranks, ids[left], ids[right], n)
        if now < 0 or new_by_rank[now] != new_by_rank[r]:  # an entry the merges since made stale
            continue
        ids[left] = new_by_rank[r]
        alive[right] = False
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        p = prv[left]
        if p >= 0:
            r2 = _lookup(keys, ranks, ids[p], ids[left], n)
            if r2 >= 0:
                size = _push(heap, size, (r2 << 32) | p)
        q = nxt[left]
        if q >= 0:
            r2 = _lookup(keys, ranks, ids[left], ids[q], n)
            if r2 >= 0:
                size = _push(heap, size, (r2 << 32) | left)
    out = np.empty(s, dtype=np.int64)
    k = 0
    for i in range(s):
        if alive[i]:
            out[k] = ids[i]
            k += 1
    return out[:k]
