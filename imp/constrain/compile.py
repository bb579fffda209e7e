"""Compile constraints off the event loop, under a deadline, once per spec.

Compiling (grammar text -> llguidance parser, lexer and the first mask) is
microseconds for most specs and seconds for hostile ones; it runs on this
cache's own small thread pool (llguidance drops the GIL while it builds),
so the asyncio loop that awaits `compile` keeps serving (/health answers).

The deadline: a compile that has not finished in `timeout_s` raises
ConstraintError naming the deadline. Python cannot kill a thread, so the
compile runs on; llguidance's fuel and size limits bound how long, and its
eventual result (success or error) still lands in the cache, so asking
again is answered at once. While as many compiles as there are workers are
past their deadlines, new ones are refused ("compiler busy") instead of
queueing behind them.

Cache: compiled grammars by SHA-256 of (kind, strict, source), LRU-bounded;
failures are cached too (a hostile spec sent again costs nothing). A cached
entry holds a pristine, never-advanced llguidance matcher; each sequence
gets a deep copy (`CompiledGrammar.matcher()`), which shares nothing
mutable with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np

from imp.constrain.errors import ConstraintError
from imp.constrain.limits import SchemaLimits
from imp.constrain.matcher import SeqMatcher, mask_words
from imp.constrain.spec import Constraint, grammar_text

DEFAULT_TIMEOUT_S = 1.0


def default_parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits, as we run it. Its defaults already bound each mask step (lexer
    fuel ~15 ms, Earley items ~3 ms) and the grammar size; we only stop it putting its
    parser-state dump into error messages (they go back to clients)."""
    return llguidance.LLParserLimits(verbose_errors=False)


def spec_key(spec: Constraint) -> str:
    """Cache key: SHA-256 over the fields that decide the grammar."""
    h = hashlib.sha256()
    for part in (spec.kind, "1" if spec.strict else "0", spec.source):
        b = part.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled constraint: what every sequence's matcher is copied from."""

    key: str
    spec: Constraint
    grammar: str  # the llguidance grammar text it was built from
    warnings: tuple[str, ...]
    compile_s: float  # wall time of the compile
    template: llguidance.LLMatcher  # never advanced; only deep-copied
    eos_ids: frozenset[int]
    vocab_size: int

    def matcher(self) -> SeqMatcher:
        """A fresh matcher at the start of the grammar (a deep copy: ~0.01-4 ms, the larger
        for big grammars; safe from any thread)."""
        return SeqMatcher(self.template.deep_copy(), self.eos_ids, self.vocab_size, self.key)


class GrammarCache:
    """One per server (per vocabulary): compiles, caches and hands out grammars.

    Thread-safe: `compile` (from the event loop), `compile_sync` and `get` (from any
    thread) may run concurrently."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, limits: SchemaLimits | None = None,
                 parser_limits: llguidance.LLParserLimits | None = None, max_entries: int = 256,
                 workers: int = 2, mask_threads: int | None = None):
        self.tokenizer = tokenizer
        self.limits = limits or SchemaLimits()
        self.parser_limits = parser_limits or default_parser_limits()
        self.max_entries = max_entries
        self.workers = workers
        self._eos = frozenset(tokenizer.eos_tokens)
        self._vocab = tokenizer.vocab_size
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="imp-grammar")
        self._lock = threading.RLock()  # RLock: a done-callback may run inside _future's critical section
        self._done: OrderedDict[str, CompiledGrammar | ConstraintError] = OrderedDict()
        self._running: dict[str, cf.Future] = {}
        self._overdue: set[str] = set()
        self._executor: llguidance.LLExecutor | None = None
        self._mask_threads = mask_threads
        self.hits = 0
        self.misses = 0

    @property
    def executor(self) -> llguidance.LLExecutor:
        """llguidance's Rust thread pool for `matcher.fill_masks` (created on first use;
        mask_threads None = its default, 80% of the cores up to 32)."""
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._mask_threads)
            return self._executor

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def mask_words(self) -> int:
        return mask_words(self._vocab)

    # ------------------------------------------------------------------ public

    async def compile(self, spec: Constraint, timeout_s: float = DEFAULT_TIMEOUT_S) -> CompiledGrammar:
        """Compile (or fetch) `spec` without blocking the loop; ConstraintError within
        ~timeout_s when it cannot be compiled."""
        key, fut = self._future(spec)
        if isinstance(fut, (CompiledGrammar, ConstraintError)):
            return _unwrap(fut)  # cached: no thread hop
        wrapped = asyncio.wrap_future(fut)
        # asyncio.wait (not wait_for) never cancels the compile: another request for the
        # same spec may be waiting on it, and its result is worth caching.
        done, _ = await asyncio.wait({wrapped}, timeout=timeout_s)
        if not done:
            raise self._timed_out(key, fut, timeout_s)
        wrapped.exception()  # seen here (the outcome is read from fut): asyncio logs no "never retrieved"
        return _unwrap(_outcome(fut))

    def compile_sync(self, spec: Constraint, timeout_s: float = DEFAULT_TIMEOUT_S) -> CompiledGrammar:
        """The same, blocking the calling thread (never call it on the event loop)."""
        key, fut = self._future(spec)
        if isinstance(fut, (CompiledGrammar, ConstraintError)):
            return _unwrap(fut)
        done, _ = cf.wait([fut], timeout=timeout_s)
        if not done:
            raise self._timed_out(key, fut, timeout_s)
        return _unwrap(_outcome(fut))

    def get(self, spec: Constraint) -> CompiledGrammar | None:
        """The compiled grammar if it is cached (compiled fine), else None. For the executor,
        which creates matchers for specs that admission already compiled."""
        got = self._lookup(spec_key(spec))
        return got if isinstance(got, CompiledGrammar) else None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._done), "running": len(self._running), "overdue": len(self._overdue),
                    "hits": self.hits, "misses": self.misses}

    def close(self) -> None:
        """Stop the compile threads (running compiles finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _lookup(self, key: str) -> CompiledGrammar | ConstraintError | None:
        with self._lock:
            got = self._done.get(key)
            if got is not None:
                self._done.move_to_end(key)
                self.hits += 1
            return got

    def _future(self, spec: Constraint) -> tuple[str, cf.Future | CompiledGrammar | ConstraintError]:
        key = spec_key(spec)
        with self._lock:
            got = self._lookup(key)
            if got is not None:
                return key, got
            fut = self._running.get(key)
            if fut is not None:  # the same spec is compiling: wait on that compile
                return key, fut
            if len(self._overdue) >= self.workers:
                raise ConstraintError(
                    f"grammar compiler busy: {len(self._overdue)} compiles are past their deadline")
            self.misses += 1
            fut = self._pool.submit(self._build, spec, key)
            self._running[key] = fut
            fut.add_done_callback(lambda f, k=key: self._finished(k, f))
            return key, fut

    def _finished(self, key: str, fut: cf.Future) -> None:
        result = _outcome(fut)
        with self._lock:
            self._running.pop(key, None)
            self._overdue.discard(key)
            self._done[key] = result
            self._done.move_to_end(key)
            while len(self._done) > self.max_entries:
                self._done.popitem(last=False)

    def _timed_out(self, key: str, fut: cf.Future, timeout_s: float) -> ConstraintError:
        with self._lock:
            if not fut.done():
                self._overdue.add(key)
        return ConstraintError(f"grammar did not compile within the {timeout_s:g} s deadline "
                               "(schema or grammar too complex)")

    def _build(self, spec: Constraint, key: str) -> CompiledGrammar:
        """On a worker thread: grammar text, llguidance parser, and the first mask."""
        t0 = time.perf_counter()
        grammar = grammar_text(spec, self.limits)
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.parser_limits)
        if m.is_error():
            raise ConstraintError(f"{spec.kind}: {m.get_error()}")
        warnings = tuple(m.get_grammar_warnings())
        # The first mask, computed on the template itself: it catches grammars that fail on
        # their first step (lexer over its limits) or allow no token at all, and the lexer
        # states it builds are inherited by every deep copy, so sequences start warm.
        row = np.zeros(mask_words(self._vocab), dtype=np.int32)
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
        if m.is_error():
            raise ConstraintError(f"{spec.kind}: {m.get_error()}")
        if not bool(row.any()):
            raise ConstraintError(f"{spec.kind}: the grammar allows no token at its start")
        return CompiledGrammar(key, spec, grammar, warnings, time.perf_counter() - t0, m, self._eos, self._vocab)


def _outcome(fut: cf.Future) -> CompiledGrammar | ConstraintError:
    """A finished compile's result, or its error as a traceback-free ConstraintError (it is
    cached: a traceback would keep the worker's frames alive)."""
    if fut.cancelled():
        return ConstraintError("grammar compile was cancelled")
    exc = fut.exception()
    if exc is None:
        return fut.result()
    if isinstance(exc, ConstraintError):
        return ConstraintError(exc.reason)
    return ConstraintError(f"grammar compile failed: {exc!r}")


def _unwrap(got: CompiledGrammar | ConstraintError) -> CompiledGrammar:
    if isinstance(got, ConstraintError):
        # a fresh exception each time: a cached one would pile up tracebacks
        raise ConstraintError(got.reason)
    return got
