"""Our numpy dequantizers against gguf's reference ones, on random blocks."""

from imp.formats.quants import DEQUANT, UnsupportedQuantError, dequantize

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

# types gguf.quants can quantize: round-trip real data through them
QUANTIZABLE = [T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# types gguf only dequantizes: random bytes with the f16 scale fields made sane
RANDOM_BYTES = {  # type -> byte offsets of f16 scale fields in a block
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}


def _random_blocks(qtype, n_blocks, rng):
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in RANDOM_BYTES[qtype]:
        scale = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        b[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return b


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_roundtrip_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((8, 256)).astype(np.float32)
    raw = gq.quantize(x, qtype)
    ref = gq.dequantize(raw, qtype)
    ours = dequantize(raw, qtype, ref.shape)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("qtype", list(RANDOM_BYTES), ids=lambda t: t.name)
def test_random_blocks_match_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = _random_blocks(qtype, 64, rng).reshape(4, -1)  # 4 rows of 16 blocks
    ref = gq.dequantize(raw, qtype)
    ours = dequantize(raw, qtype, (4, 16 * block))
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def test_plain_floats():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(x, T.F32, (3, 64)), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(dequantize(h.view(np.uint8), T.F16, (3, 64)), h.astype(np.float32))


def test_all_listed_types_covered():
    want = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K,
            T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS}
    assert want <= set(DEQUANT)


def test_unsupported_names_tensor_and_type():
    with pytest.raises(UnsupportedQuantError, match=r"blk\.0\.x.*IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (256,), name="blk.0.x")
