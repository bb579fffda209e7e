"""Constrained decoding on llguidance: specs, our vocabulary's tokenizer view,
compiled-grammar cache, per-sequence matchers and logits masks.

Layer rule: imports only imp.messages and imp.kernels (tests/test_architecture.py).

Engine wiring, in order:
    tok = build_tokenizer([t.piece_bytes(i) for i in range(V)], t.eos_ids, specials)   # once per model
    cache = GrammarCache(tok)                                                          # once per server
    compiled = await cache.compile(Constraint("json_schema", text, strict=True))     # admission: 400 on error
    m = compiled.matcher()                                                            # executor, per sequence
    each step: fill_masks([(m, i), ...], bitmask, cache.executor); apply_mask(logits, bitmask, rows)
               sample; m.advance(token)
"""

from imp.constrain.compile import CompiledGrammar, GrammarCache, spec_key
from imp.constrain.errors import ConstraintError
from imp.constrain.limits import SchemaLimits
from imp.constrain.mask import alloc_bitmask, apply_mask
from imp.constrain.matcher import SeqMatcher, fill_masks, mask_words
from imp.constrain.spec import KINDS, Constraint, grammar_text
from imp.constrain.vocab import TokenizerView, build_tokenizer

__all__ = [
    "KINDS", "CompiledGrammar", "Constraint", "ConstraintError", "GrammarCache", "SchemaLimits", "SeqMatcher",
    "TokenizerView", "alloc_bitmask", "apply_mask", "build_tokenizer", "fill_masks", "grammar_text", "mask_words",
    "spec_key",
]
