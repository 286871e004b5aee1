"""Our torch dequantization vs the gguf package's reference (numpy), on odd row counts."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from quant_blocks import K_QUANTS, random_blocks

from pyruntime.gguf.quant import dequantize, row_bytes


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.MXFP4])
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 64), (1, 32)])
def test_dequantize_matches_gguf(qtype, shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    raw = quants.quantize(x, qtype)
    ref = quants.dequantize(raw, qtype).reshape(shape)
    got = dequantize(raw, qtype, shape).numpy()
    # Both decode the same stored bytes: identical up to float32 rounding of d*q.
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
    assert raw.reshape(-1).view(np.uint8).size == row_bytes(qtype, shape[-1]) * int(
        np.prod(shape[:-1])
    )


def test_dequantize_rejects_wrong_size():
    raw = quants.quantize(np.zeros((2, 64), np.float32), Q.Q8_0)
    with pytest.raises(ValueError):
        dequantize(raw, Q.Q8_0, (3, 64))


def test_mxfp4_scales_span_the_e8m0_range():
    """Block scales from subnormal (e 0, 1) to huge, every e2m1 code: exactly gguf's values."""
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (253, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(253)  # E8M0 codes 0..252 (253 and up overflow f32 times 12)
    ref = quants.dequantize(raw, Q.MXFP4)
    got = dequantize(raw, Q.MXFP4, ref.shape).numpy()
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 64), (1, 32)])
def test_dequantize_q5_matches_gguf(qtype, shape):
    """Legacy 5-bit formats (llama.cpp's fallback for K-quant rows not a multiple of 256)."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    raw = quants.quantize(x, qtype)
    ref = quants.dequantize(raw, qtype).reshape(shape)
    got = dequantize(raw, qtype, shape).numpy()
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("qtype", list(K_QUANTS.values()))
@pytest.mark.parametrize("shape", [(7, 768), (3, 2, 256)])
def test_dequantize_k_quants_match_gguf(qtype, shape):
    """Every code and packed scale/min pattern (random bytes), odd row counts, several
    super-blocks a row: exactly gguf-py's values."""
    rng = np.random.default_rng(3)
    rows = int(np.prod(shape[:-1]))
    raw = random_blocks(qtype, rows, shape[-1], rng, scale=0.5)
    ref = quants.dequantize(raw, qtype).reshape(shape)
    got = dequantize(raw, qtype, shape).numpy()
    assert np.array_equal(got, ref)
    assert raw.size == row_bytes(qtype, shape[-1]) * rows
