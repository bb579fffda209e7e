"""The constraint layer (imp/constrain) on the real SmolLM2 vocabulary and a synthetic one.

The core check is a random walk: at each step the matcher's mask is applied
to random logits, a token is sampled from the softmax (so only allowed
tokens can come out), and the walk goes on until EOS. The output must then
satisfy the constraint, checked independently (jsonschema, `re.fullmatch`),
every masked token must have had probability exactly 0, and EOS must have
been allowed exactly where the matcher said the output could end.

CPU only, fast; the GPU kernel is in tests/test_gpu_token_mask.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import jsonschema
import pytest
import torch

from imp.constrain import (Constraint, ConstraintError, GrammarCache, SchemaLimits, SeqMatcher, alloc_bitmask,
                           apply_mask, build_tokenizer, fill_masks, grammar_text, mask_words, spec_key)
from imp.kernels.cuda import token_mask
from imp.text.tokenizer import Tokenizer

# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The walks do many small ops on 49k-wide rows: on a shared 2-core box torch's
    intra-op threads spin against each other and a step takes 50x longer."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smol(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def _view(tk: Tokenizer, **kw):
    specials = {i for i in range(tk.vocab_size) if tk.is_special(i)}
    return build_tokenizer([tk.piece_bytes(i) for i in range(tk.vocab_size)], tk.eos_ids, specials,
                           bos_id=tk.bos_id, encode=tk.encode, **kw)


@pytest.fixture(scope="module")
def lltok(smol):
    return _view(smol)


@pytest.fixture(scope="module")
def cache(lltok):
    c = GrammarCache(lltok)
    yield c
    c.close()


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Tokenizer:
    from tests.fixtures.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path_factory.mktemp("synth") / "s.gguf", vocab=300, n_layers=1, d_model=32,
                                n_heads=2, n_kv_heads=1, d_ff=64)
    return Tokenizer.from_gguf(path)


# ---------------------------------------------------------------------------- the random walk


def _alloc(n_rows: int, vocab: int) -> torch.Tensor:
    """alloc_bitmask's numpy rows as a torch tensor sharing them: the masks also take CPU tensors."""
    return torch.from_numpy(alloc_bitmask(n_rows, vocab))


def _bits(row, V: int) -> torch.Tensor:
    """Allowed-token booleans [V] of one bitmask row (the reference unpacking)."""
    row = torch.as_tensor(row)
    shifts = torch.arange(32, dtype=torch.int32)
    return ((row.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:V].bool()


def walk(m: SeqMatcher, eos_ids, V: int, seed: int, max_steps: int = 400, p_eos: float = 0.5,
         masks: list | None = None) -> list[int]:
    """Sample until EOS; return the tokens before it. Asserts the mask invariants each step."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    bm = _alloc(1, V)
    eos = sorted(eos_ids)
    for step in range(max_steps):
        m.fill_mask(bm[0])
        assert m.error is None
        if masks is not None:
            masks.append(bm[0].clone())
        allowed = _bits(bm[0], V)
        assert allowed.any(), "a mask with no token allowed"
        eos_ok = bool(allowed[eos].any())
        assert eos_ok == m.accepting(), "EOS allowed exactly where the grammar may end"
        if m.done():
            assert allowed.sum() == sum(allowed[e] for e in eos), "a finished grammar allows EOS only"
        if step % 4 == 0:  # the sampler's view, every few steps (a full softmax is the slow part)
            logits = torch.randn(1, V, generator=g) * 3
            apply_mask(logits, bm)
            probs = torch.softmax(logits, dim=-1)[0]
            assert torch.all(probs[~allowed] == 0), "a masked token kept probability > 0"
            # (float64 sum: 49k float32 probabilities summed in float32 round past isclose's 1e-5 on some
            # CPUs' kernels; a masked-out mass would show as far more)
            assert abs(probs[allowed].double().sum().item() - 1.0) < 1e-4
        if eos_ok and (m.done() or rnd.random() < p_eos):
            tok = next(e for e in eos if allowed[e])
        else:
            choices = allowed.clone()
            choices[eos] = False  # sample a non-EOS continuation
            idx = torch.nonzero(choices).flatten()
            tok = int(idx[int(torch.randint(len(idx), (1,), generator=g))])
        m.advance(tok)
        if tok in eos_ids:
            out = m.tokens[:-1]
            assert all(t not in eos_ids for t in out)
            return list(out)
    raise AssertionError(f"no EOS within {max_steps} steps: {m.tokens[:50]}...")


def text_of(tk: Tokenizer, ids: list[int]) -> str:
    b = tk.decode_bytes(ids, skip_special=False)
    return b.decode("utf-8")  # a grammar over text never ends inside a character


# ---------------------------------------------------------------------------- vocabulary


def test_tokenizer_view_of_smollm2(smol, lltok):
    assert lltok.vocab_size == smol.vocab_size == 49152
    assert sorted(lltok.eos_tokens) == sorted(smol.eos_ids)
    for i in range(smol.vocab_size):
        assert lltok.is_special_token(i) == (smol.is_special(i) or i in smol.eos_ids)
    ids = smol.encode("Hello, {\"a\": [1, 2]} wörld 👍")
    assert lltok.decode_bytes(ids) == smol.decode_bytes(ids)


def test_special_tokens_are_not_produced_by_their_text(smol, cache):
    """A grammar that spells `<|im_end|>` as text gets it from byte tokens, never the special id."""
    im_end = next(i for i in range(smol.vocab_size) if smol.piece_bytes(i) == b"<|im_end|>")
    m = cache.compile_sync(Constraint("regex", r"<\|im_end\|> ok")).matcher()
    bm = _alloc(1, smol.vocab_size)
    m.fill_mask(bm[0])
    allowed = _bits(bm[0], smol.vocab_size)
    assert not allowed[im_end]
    assert allowed[smol.encode("<")[0]]
    with pytest.raises(ConstraintError, match="not allowed"):
        m.advance(im_end)
    out = walk(m, smol.eos_ids, smol.vocab_size, seed=3)
    assert text_of(smol, out) == "<|im_end|> ok"
    assert all(not smol.is_special(t) for t in out)


def test_lark_may_name_a_special_token(smol, cache):
    """The other side of the same rule: a Lark grammar that *names* the token gets the special id."""
    sep = next(i for i in range(smol.vocab_size) if smol.piece_bytes(i) == b"<file_sep>")
    assert smol.is_special(sep) and sep not in smol.eos_ids
    out = walk(cache.compile_sync(Constraint("lark", 'start: "hi" <file_sep>')).matcher(), smol.eos_ids,
               smol.vocab_size, seed=1)
    assert out[-1] == sep and text_of(smol, out[:-1]) == "hi"


def test_synthetic_vocabulary(synth):
    lt = _view(synth)
    assert lt.vocab_size == synth.vocab_size == 300
    cache = GrammarCache(lt)
    try:
        m = cache.compile_sync(Constraint("regex", r"(ta|t){2,4}!")).matcher()
        for seed in range(5):
            m.reset()
            out = walk(m, synth.eos_ids, 300, seed=seed)
            assert re.fullmatch(r"(ta|t){2,4}!", text_of(synth, out))
        # specials (ids 0-2 in the synthetic vocab) are never in a text mask
        bm = _alloc(1, 300)
        cache.compile_sync(Constraint("regex", r"<\|im_start\|>")).matcher().fill_mask(bm[0])
        assert not _bits(bm[0], 300)[:3].any()
    finally:
        cache.close()


def test_padding_ids_never_allowed(smol):
    V = smol.vocab_size + 70  # a model whose logits are wider than its vocabulary
    lt = _view(smol, n_vocab=V)
    assert lt.vocab_size == V
    cache = GrammarCache(lt)
    try:
        m = cache.compile_sync(Constraint("regex", r"[a-z ]{1,40}")).matcher()
        bm = _alloc(1, V)
        assert bm.shape[1] == mask_words(V) == (V + 31) // 32
        m.fill_mask(bm[0])
        assert not _bits(bm[0], V)[smol.vocab_size:].any()
    finally:
        cache.close()


def test_build_tokenizer_refuses_bad_input():
    with pytest.raises(ValueError, match="EOS"):
        build_tokenizer([b"a", b"b"], [], set())
    with pytest.raises(ValueError, match="outside"):
        build_tokenizer([b"a", b"b"], [5], set())
    with pytest.raises(ValueError, match="n_vocab"):
        build_tokenizer([b"a", b"b"], [0], set(), n_vocab=1)


# ---------------------------------------------------------------------------- every kind, by random walk

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object",
     "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                    "temps": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                              "maxItems": 4},
                    "ok": {"type": "boolean"}, "note": {"anyOf": [{"type": "null"}, {"type": "string",
                                                                                     "maxLength": 6}]}},
     "required": ["city", "temps"]},
    {"type": "object",  # a tool call, as the tool-calling layer will build them
     "properties": {"name": {"const": "get_weather"},
                    "arguments": {"type": "object",
                                  "properties": {"location": {"type": "string", "maxLength": 10},
                                                 "unit": {"enum": ["c", "f"]}},
                                  "required": ["location", "unit"]}},
     "required": ["name", "arguments"]},
]


def _closed(schema: dict) -> dict:
    """The schema with additionalProperties false on every object (what strict implies)."""
    s = json.loads(json.dumps(schema))
    stack = [s]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("type") == "object":
                n.setdefault("additionalProperties", False)
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return s


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("schema_i", range(len(SCHEMAS)))
def test_json_schema_walks_validate(smol, cache, schema_i, strict):
    schema = SCHEMAS[schema_i]
    # strict closes every object itself; without strict the walk needs the schema to say so,
    # or it wanders off into extra properties forever (a random walk has no reason to stop)
    closed = _closed(schema)
    compiled = cache.compile_sync(Constraint("json_schema", json.dumps(schema if strict else closed), strict=strict))
    for seed in range(3):
        out = walk(compiled.matcher(), smol.eos_ids, smol.vocab_size, seed=seed + 10 * schema_i)
        jsonschema.validate(json.loads(text_of(smol, out)), closed)


def test_json_object_walks_parse(smol, cache):
    compiled = cache.compile_sync(Constraint("json_object"))
    for seed in range(3):
        m = compiled.matcher()
        out = walk(m, smol.eos_ids, smol.vocab_size, seed=seed, max_steps=2000, p_eos=1.0)
        assert isinstance(json.loads(text_of(smol, out)), dict)


REGEXES = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe)( because [a-z ]{1,20})?\.",
           r"[A-Z][a-z]{0,8}@[a-z]{1,6}\.(com|org)"]


@pytest.mark.parametrize("rx", REGEXES)
def test_regex_walks_fullmatch(smol, cache, rx):
    compiled = cache.compile_sync(Constraint("regex", rx))
    for seed in range(3):
        out = walk(compiled.matcher(), smol.eos_ids, smol.vocab_size, seed=seed)
        assert re.fullmatch(rx, text_of(smol, out))


# bounded grammars (every walk ends) with a Python regex that accepts the same language
GBNF = ('root ::= item ("," item){0,4}\n'
        'item ::= word | num\n'
        'word ::= [a-z]{1,5}\n'
        'num  ::= "-"? [0-9]{1,3}\n')
GBNF_RE = r"([a-z]{1,5}|-?[0-9]{1,3})(,([a-z]{1,5}|-?[0-9]{1,3})){0,4}"
LARK = ('start: "(" pair (";" pair)* ")"\n'
        'pair: KEY "=" VAL\n'
        'KEY: /[a-z]{1,4}/\n'
        'VAL: /[0-9]{1,2}/ | "true" | "false"\n')
LARK_RE = r"\((?:[a-z]{1,4}=(?:[0-9]{1,2}|true|false))(?:;[a-z]{1,4}=(?:[0-9]{1,2}|true|false))*\)"


@pytest.mark.parametrize("kind,source,pattern", [("gbnf", GBNF, GBNF_RE), ("lark", LARK, LARK_RE)])
def test_grammar_walks_parse(smol, cache, kind, source, pattern):
    compiled = cache.compile_sync(Constraint(kind, source))
    for seed in range(4):
        out = walk(compiled.matcher(), smol.eos_ids, smol.vocab_size, seed=seed, p_eos=0.3)
        text = text_of(smol, out)
        assert re.fullmatch(pattern, text), text
        # and llguidance's own verdict, from a fresh matcher fed our tokenization of the text
        again = compiled.matcher()
        for t in smol.encode(text):
            again.advance(t)
        assert again.accepting()


# ---------------------------------------------------------------------------- strict, errors, advance


def test_strict_refuses_extra_properties(smol, cache):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    prefix = smol.encode('{"a": 1, "b')
    loose = cache.compile_sync(Constraint("json_schema", schema)).matcher()
    for t in prefix:
        loose.advance(t)
    strict = cache.compile_sync(Constraint("json_schema", schema, strict=True)).matcher()
    with pytest.raises(ConstraintError, match="not allowed"):
        for t in prefix:
            strict.advance(t)


def test_strict_root_must_be_an_object(cache):
    cache.compile_sync(Constraint("json_schema", '{"type": "integer"}'))  # fine without strict
    with pytest.raises(ConstraintError, match="root schema"):
        cache.compile_sync(Constraint("json_schema", '{"type": "integer"}', strict=True))


def test_strict_grammar_text_closes_nested_objects():
    g = json.loads(grammar_text(Constraint("json_schema", json.dumps(
        {"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "string"}}}},
         "$defs": {"d": {"properties": {"y": {}}}}}), strict=True)))
    schema = g["grammars"][0]["json_schema"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["o"]["additionalProperties"] is False
    assert schema["$defs"]["d"]["additionalProperties"] is False


def test_unsupported_keyword_is_an_error_not_ignored(cache):
    with pytest.raises(ConstraintError, match="format"):
        cache.compile_sync(Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'))


def test_unknown_kind(cache):
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        cache.compile_sync(Constraint("xml", "<a/>"))


def test_advance_refuses_a_disallowed_token_and_stays_usable(smol, cache):
    m = cache.compile_sync(Constraint("regex", r"[0-9]+")).matcher()
    bm0, bm1 = _alloc(1, smol.vocab_size), _alloc(1, smol.vocab_size)
    m.fill_mask(bm0[0])
    with pytest.raises(ConstraintError, match="not allowed"):
        m.advance(smol.encode("x")[0])
    assert m.tokens == [] and m.error is None
    m.fill_mask(bm1[0])
    assert torch.equal(bm0, bm1)
    with pytest.raises(ConstraintError):
        m.advance(next(iter(smol.eos_ids)))  # EOS before the grammar may end
    m.advance(smol.encode("7")[0])
    assert m.accepting() and not m.done()


def test_done_means_eos_only_and_eos_after_done(smol, cache):
    m = cache.compile_sync(Constraint("regex", "ok")).matcher()
    for t in smol.encode("ok"):
        m.advance(t)
    assert m.done() and m.accepting()
    eos = sorted(smol.eos_ids)
    bm = _alloc(1, smol.vocab_size)
    m.fill_mask(bm[0])
    assert torch.nonzero(_bits(bm[0], smol.vocab_size)).flatten().tolist() == eos
    with pytest.raises(ConstraintError):
        m.advance(smol.encode("x")[0])
    n = len(m.tokens)
    m.advance(eos[0])  # EOS after llguidance stopped: kept as a virtual token
    assert len(m.tokens) == n + 1
    m.rollback(1)  # drops the virtual EOS only
    assert len(m.tokens) == n and m.done()
    m.rollback(n)
    assert m.tokens == [] and not m.accepting()


# ---------------------------------------------------------------------------- sync / rollback


def test_sync_rebuilds_the_same_masks_after_preemption(smol, cache):
    compiled = cache.compile_sync(Constraint("json_schema", json.dumps(_closed(SCHEMAS[1]))))
    masks: list[torch.Tensor] = []
    out = walk(compiled.matcher(), smol.eos_ids, smol.vocab_size, seed=5, masks=masks)
    assert len(out) > 6
    bm = _alloc(1, smol.vocab_size)
    # preempted after k tokens, recomputed: a fresh matcher synced to the output so far
    for k in (0, 1, len(out) // 2, len(out)):
        m = compiled.matcher()
        m.sync(out[:k])
        m.fill_mask(bm[0])
        assert torch.equal(bm[0], masks[k]), k
    # a matcher that ran ahead on a different continuation syncs back (rollback + replay)
    m = compiled.matcher()
    m.sync(out)
    m.rollback(3)
    m.sync(out[: len(out) // 2])
    m.fill_mask(bm[0])
    assert torch.equal(bm[0], masks[len(out) // 2])
    m.sync(out)
    m.fill_mask(bm[0])
    assert torch.equal(bm[0], masks[len(out)])
    # in sync already: a list compare, nothing replayed
    t0 = time.perf_counter()
    for _ in range(1000):
        m.sync(out)
    assert (time.perf_counter() - t0) / 1000 < 1e-3
    with pytest.raises(ConstraintError):
        m.sync(out[:2] + smol.encode("\x00zz"))


def test_fork_is_independent(smol, cache):
    m = cache.compile_sync(Constraint("regex", r"(ab|cd)[0-9]{2}")).matcher()
    for t in smol.encode("ab"):
        m.advance(t)
    twin = m.fork()
    assert twin.tokens == m.tokens and twin.tokens is not m.tokens
    twin.advance(smol.encode("1")[0])
    a, b = _alloc(1, smol.vocab_size), _alloc(1, smol.vocab_size)
    m.fill_mask(a[0])
    fresh = cache.compile_sync(Constraint("regex", r"(ab|cd)[0-9]{2}")).matcher()
    fresh.sync(m.tokens)
    fresh.fill_mask(b[0])
    assert torch.equal(a, b) and len(twin.tokens) == len(m.tokens) + 1


def test_constraint_is_plain_message_data():
    import msgspec

    c = Constraint("json_schema", '{"type": "object"}', strict=True)
    for enc, dec in ((msgspec.msgpack.encode, msgspec.msgpack.decode), (msgspec.json.encode, msgspec.json.decode)):
        assert dec(enc(c), type=Constraint) == c
    assert msgspec.json.encode(c) == b'["json_schema","{\\"type\\": \\"object\\"}",true]'  # array_like: small
    with pytest.raises(AttributeError):
        c.kind = "regex"  # frozen


def test_fill_masks_batched_equals_one_by_one(smol, cache):
    compiled = [cache.compile_sync(Constraint("json_schema", json.dumps(_closed(s)))) for s in SCHEMAS]
    ms = [c.matcher() for c in compiled for _ in range(2)]
    for i, m in enumerate(ms):  # move them to different states
        m.sync(walk(compiled[i // 2].matcher(), smol.eos_ids, smol.vocab_size, seed=i)[: i + 1])
    batch = _alloc(len(ms) + 2, smol.vocab_size)
    rows = [(m, i + 1) for i, m in enumerate(ms)]  # rows 0 and -1 stay unconstrained (all ones)
    fill_masks(rows, batch, cache.executor)
    one = _alloc(1, smol.vocab_size)
    for m, i in rows:
        m.fill_mask(one[0])
        assert torch.equal(batch[i], one[0])
    assert (batch[0] == -1).all() and (batch[-1] == -1).all()


def test_forced_tokens(smol, cache):
    m = cache.compile_sync(Constraint("regex", r"The answer is [0-9]")).matcher()
    ff = m.forced_tokens()
    assert ff and "The answer is ".startswith(smol.decode(ff))
    for t in ff:
        m.advance(t)


# ---------------------------------------------------------------------------- masks


@pytest.mark.parametrize("V", [1000, 49152, 77])
def test_apply_mask_matches_reference(V):
    g = torch.Generator().manual_seed(V)
    R = 5
    logits = torch.randn(R, V, generator=g)
    bm = torch.randint(-2**31, 2**31 - 1, (3, mask_words(V)), dtype=torch.int32, generator=g)
    rows = [3, -1, 0]  # row -1: skipped; rows 1, 2, 4: unconstrained neighbours
    want = token_mask.reference(logits, bm, torch.tensor(rows, dtype=torch.int32))
    got = logits.clone()
    apply_mask(got, bm, rows)
    assert torch.equal(got, want)
    for r in (1, 2, 4):
        assert torch.equal(got[r], logits[r])
    allowed = _bits(bm[0], V)
    assert torch.all(torch.softmax(got[3], -1)[~allowed] == 0)
    full = logits[:3].clone()
    apply_mask(full, bm)
    assert torch.equal(full, token_mask.reference(logits[:3], bm))


def test_apply_mask_checks_shapes():
    with pytest.raises(ValueError):
        apply_mask(torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_mask(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_mask(torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), rows=[2])
    m_rows = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError):
        apply_mask(torch.zeros(1, 64), m_rows)


# ---------------------------------------------------------------------------- cache and deadline


def test_cache_hits_on_the_same_spec(cache):
    spec = Constraint("regex", r"cache-[0-9]{2}")
    before = cache.stats()
    a = cache.compile_sync(spec)
    b = cache.compile_sync(Constraint("regex", r"cache-[0-9]{2}"))
    assert a is b and cache.get(spec) is a
    after = cache.stats()
    assert after["misses"] == before["misses"] + 1 and after["hits"] >= before["hits"] + 2
    assert spec_key(spec) != spec_key(Constraint("regex", r"cache-[0-9]{2}", strict=True))
    assert spec_key(Constraint("lark", "ab")) != spec_key(Constraint("regex", "ab"))


async def test_async_compile_and_failures_are_cached(cache):
    spec = Constraint("regex", r"async-[a-z]+")
    a = await cache.compile(spec)
    assert (await cache.compile(spec)) is a
    bad = Constraint("regex", "(")
    with pytest.raises(ConstraintError):
        await cache.compile(bad)
    misses = cache.stats()["misses"]
    with pytest.raises(ConstraintError, match="unclosed group"):
        await cache.compile(bad)
    assert cache.stats()["misses"] == misses


def _nested_one_of(depth: int) -> dict:
    """oneOf of overlapping objects, each branch holding the level below twice: 4**depth
    subschemas once inlined (3.6 MB of JSON at depth 8)."""
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"oneOf": [{"type": "object", "properties": {"a": s, "b": s}},
                       {"type": "object", "properties": {"b": s, "c": s}}]}
    return {"type": "object", "properties": {"root": s}}


def _nested_one_of_refs(depth: int) -> dict:
    """The same 8 levels written compactly with $ref (1.7 kB): nothing for our limits to
    count, so llguidance itself must refuse it."""
    defs: dict = {"d0": {"type": "string"}}
    for i in range(1, depth + 1):
        r = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"oneOf": [{"type": "object", "properties": {"a": r, "b": r}},
                                   {"type": "object", "properties": {"b": r, "c": r}}]}
    return {"type": "object", "properties": {"root": {"$ref": f"#/$defs/d{depth}"}}, "$defs": defs}


def _schema(s: dict, strict: bool = False):
    return lambda: Constraint("json_schema", json.dumps(s), strict=strict)


PATHOLOGICAL = {  # name -> (spec maker, what the reason must mention)
    "nested oneOf 8 deep (inline)": (lambda: Constraint("json_schema", json.dumps(_nested_one_of(8))),
                                     "characters long"),
    "nested oneOf 6 deep (inline), strict": (
        lambda: Constraint("json_schema", json.dumps(_nested_one_of(6)), strict=True), "properties"),
    "nested oneOf 8 deep ($ref)": (_schema(_nested_one_of_refs(8)), "oneOf"),
    "maxLength 10**9": (_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**9}}}),
                        "maxLength"),
    "minItems 10**9": (_schema({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}), "minItems"),
    "5000-property object": (_schema({"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                       for i in range(5000)}}), "properties"),
    "schema nested 10,000 deep": (lambda: Constraint("json_schema", '{"items":' * 10_000 + "{}" + "}" * 10_000),
                                  "too deep"),
    "schema nested 100 deep": (lambda: Constraint("json_schema", '{"items":' * 100 + "{}" + "}" * 100), "deeper than"),
    "invalid regex": (lambda: Constraint("regex", "[a-z"), "regex"),
    "invalid lark": (lambda: Constraint("lark", "start: foo bar\n"), "unknown name"),
    "invalid gbnf": (lambda: Constraint("gbnf", 'root ::= ( "a" '), "GBNF"),
    "gbnf undefined rule": (lambda: Constraint("gbnf", "root ::= missing"), "GBNF"),
    "non-object schema": (lambda: Constraint("json_schema", "[1, 2, 3]"), "JSON object"),
    "schema not JSON": (lambda: Constraint("json_schema", "{type: object"), "not valid JSON"),
    "unsatisfiable schema": (_schema({"type": "object", "properties": {"x": False}, "required": ["x"]}), "."),
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_specs_fail_fast(lltok, name):
    make, reason = PATHOLOGICAL[name]
    spec = make()
    cache = GrammarCache(lltok)  # a cold cache: every case is timed from scratch
    try:
        t0 = time.perf_counter()
        with pytest.raises(ConstraintError) as e:
            cache.compile_sync(spec, timeout_s=1.0)
        dt = time.perf_counter() - t0
    finally:
        cache.close()
    print(f"\n{name}: {dt * 1000:.1f} ms: {e.value.reason[:100]}")
    assert re.search(reason, e.value.reason), e.value.reason
    assert dt < 2.0


async def test_compile_does_not_block_the_loop(lltok):
    """A compile past its deadline (5,000 optional properties, our property limit lifted)
    fails at ~1 s while a task on the same loop keeps ticking; its late result is cached;
    and with the only worker still busy past its deadline, a new compile is refused at once."""
    cache = GrammarCache(lltok, limits=SchemaLimits(max_properties=100_000), workers=1)
    slow = Constraint("json_schema", json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}))
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    try:
        t0 = time.perf_counter()
        with pytest.raises(ConstraintError, match="deadline"):
            await cache.compile(slow, timeout_s=1.0)
        dt = time.perf_counter() - t0
        assert 0.9 < dt < 2.0
        with pytest.raises(ConstraintError, match="busy"):
            await cache.compile(Constraint("regex", "x"), timeout_s=1.0)
        stop.set()
        await task
        print(f"\ndeadline hit after {dt * 1000:.0f} ms; loop gaps: max {max(gaps) * 1000:.1f} ms "
              f"over {len(gaps)} ticks")
        assert len(gaps) > 20 and max(gaps) < 0.1
        # the compile runs on; once it ends, its result is the cache's answer
        for _ in range(600):
            if cache.stats()["running"] == 0:
                break
            await asyncio.sleep(0.05)
        assert cache.stats()["running"] == 0
        t1 = time.perf_counter()
        try:
            await cache.compile(slow, timeout_s=1.0)
        except ConstraintError:
            pass
        assert time.perf_counter() - t1 < 0.05
    finally:
        stop.set()
        cache.close()
