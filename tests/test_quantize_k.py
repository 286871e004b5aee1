"""The C core's K-quant quantizers (pyrt_quantize_rows, runtime/src/quantize_k.c): the bytes
llama-quantize writes, bit for bit. Against the committed golden file (bytes llama-quantize wrote,
tests/data/kquants-llama-quantize.npz), against ggml's own quantizer through ctypes where a
llama.cpp build is on this machine (skipped elsewhere), and round trips through our decoders.
The `simd` levels run both lane widths of the search (4 lanes at scalar, 8 from AVX2 up)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from quant_blocks import random_blocks
from sanitized_c import run_sanitized_c_test

DATA = Path(__file__).resolve().parent / "data" / "kquants-llama-quantize.npz"
GGML_BASE = Path("/tmp/peers/llama.cpp/build-cpu/bin/libggml-base.so")
KQ = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
# decode(encode(x)) RMSE / RMS(x) on Gaussian rows: measured 0.089 (Q4_K), 0.045 (Q5_K),
# 0.023 (Q6_K); a quantizer off by one bit in its codes or scales measures far above these.
REL_RMSE = {"q4_k": 0.1, "q5_k": 0.05, "q6_k": 0.026}


def distributions() -> dict[str, np.ndarray]:
    """Rows that exercise the searches' edge cases, at odd row counts; lengths 256 .. 2560."""
    rng = np.random.default_rng(19)
    spike = np.zeros((3, 512))
    spike[0, 7], spike[1, 300], spike[2, 511] = 1e3, -2.5, 1e-3
    mixed = rng.standard_normal((5, 768))
    mixed[1, :256] = 0.0  # an all-zero super-block beside normal ones
    mixed[2, 32:64] = 0.0  # one all-zero sub-block
    mixed[3, ::2] = 0.5  # a run of equal values
    return {
        "gaussian": rng.standard_normal((7, 2560)),
        "heavy_tails": rng.standard_t(2, (9, 768)),
        "zeros": np.zeros((3, 256)),
        "constant": np.full((5, 256), 0.25),
        "negative_constant": np.full((3, 512), -3.0),
        "spike": spike,
        "negative_only": -np.abs(rng.standard_normal((5, 512))),
        "positive_only": np.abs(rng.standard_normal((3, 256))) + 1.0,
        "tiny": rng.standard_normal((3, 256)) * 1e-30,
        "small": rng.standard_normal((3, 256)) * 1e-6,
        "large": rng.standard_normal((3, 256)) * 1e4,
        "mixed": mixed,
    }


def ggml_quantize(lib: ctypes.CDLL, x: np.ndarray, qtype: Q, row_bytes: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], row_bytes), np.uint8)
    lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0],
                            x.shape[1], None)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ggml() -> ctypes.CDLL:
    if not GGML_BASE.is_file():
        pytest.skip(f"no llama.cpp build at {GGML_BASE.parent}")
    lib = ctypes.CDLL(str(GGML_BASE))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]  # fmt: skip
    return lib


@pytest.mark.parametrize("fmt", list(KQ))
def test_golden_bytes_of_llama_quantize(cc, simd, fmt):
    data = np.load(DATA)
    got = cc.quantize_rows(data["source"], int(KQ[fmt]))
    assert np.array_equal(got, data[fmt])


@pytest.mark.parametrize("case", list(distributions()))
@pytest.mark.parametrize("fmt", list(KQ))
def test_bytes_of_ggml_quantizer(cc, simd, ggml, fmt, case):
    x = distributions()[case]
    qtype = KQ[fmt]
    got = cc.quantize_rows(x, int(qtype))
    want = ggml_quantize(ggml, x, qtype, cc.row_bytes(int(qtype), x.shape[1]))
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"{fmt} {case}: rows {bad.tolist()} differ from ggml's"


@pytest.mark.parametrize("fmt", list(KQ))
def test_pool_gives_the_same_bytes(cc, fmt):
    x = np.random.default_rng(3).standard_normal((37, 1024)).astype(np.float32)
    alone = cc.quantize_rows(x, int(KQ[fmt]))
    with cc.CpuCore(2) as core:
        assert np.array_equal(cc.quantize_rows(x, int(KQ[fmt]), core), alone)


@pytest.mark.parametrize("fmt", list(KQ))
def test_round_trip_error(cc, fmt):
    x = np.random.default_rng(5).standard_normal((11, 2560)).astype(np.float32)
    raw = cc.quantize_rows(x, int(KQ[fmt]))
    back = quants.dequantize(raw, KQ[fmt]).reshape(x.shape)
    rel = np.sqrt(((back - x) ** 2).mean() / (x**2).mean())
    assert rel < REL_RMSE[fmt], f"{fmt}: relative RMSE {rel:.4f}"
    for case, rows in distributions().items():  # every row decodes to finite values
        back = quants.dequantize(cc.quantize_rows(rows, int(KQ[fmt])), KQ[fmt])
        assert np.isfinite(back).all(), f"{fmt} {case}"
    zeros = quants.dequantize(cc.quantize_rows(np.zeros((2, 256)), int(KQ[fmt])), KQ[fmt])
    assert not zeros.any()


@pytest.mark.parametrize("n", [0, 100, 255, 257, 384])
def test_row_length_not_a_multiple_of_256_is_one_clear_error(cc, n):
    with pytest.raises(cc.CoreError, match=f"rows of {n} elements.*multiple of 256"):
        cc.quantize_rows(np.zeros((2, n), np.float32), int(Q.Q4_K))


def test_other_formats_and_shapes_are_refused(cc):
    with pytest.raises(cc.CoreError, match="format 8 is not one of 12 Q4_K, 13 Q5_K, 14 Q6_K"):
        cc.quantize_rows(np.zeros((1, 256), np.float32), int(Q.Q8_0))
    with pytest.raises(cc.CoreError, match="rows \\[r, n\\]"):
        cc.quantize_rows(np.zeros(256, np.float32), int(Q.Q4_K))


def test_no_rows_is_no_bytes(cc):
    assert cc.quantize_rows(np.zeros((0, 512), np.float32), int(Q.Q6_K)).shape == (0, 420)


@pytest.mark.parametrize("fmt", list(KQ))
def test_dequantize_rows_is_ggufs_on_every_bit_pattern(cc, fmt):
    """pyrt_dequantize_rows on random blocks (every scale, min and code pattern) gives gguf-py's
    values, alone and on a pool."""
    qtype = KQ[fmt]
    raw = random_blocks(qtype, 13, 768, np.random.default_rng(8), scale=1.0)
    want = quants.dequantize(raw, qtype)
    assert np.array_equal(cc.dequantize_rows(raw, int(qtype), 768), want)
    with cc.CpuCore(2) as core:
        assert np.array_equal(cc.dequantize_rows(raw, int(qtype), 768, core), want)


def test_dequantize_rows_errors(cc):
    with pytest.raises(cc.CoreError, match="format 8 is not one of"):
        cc.dequantize_rows(np.zeros(34, np.uint8), int(Q.Q8_0), 32)
    with pytest.raises(cc.CoreError, match="data holds 143 bytes, the rows need 144"):
        cc.dequantize_rows(np.zeros(143 + 144, np.uint8)[:143], int(Q.Q4_K), 256)


def test_c_quantizers_under_asan_ubsan(tmp_path):
    """tests/c/test_quantize.c: both lane widths and a pool give the same bytes, round trips and
    edge rows, argument errors; with ASan + UBSan."""
    run_sanitized_c_test(tmp_path, "test_quantize", "all C quantize tests passed")
