"""The torch codecs of Q5_0, Q5_1 and the K-quants (pyruntime.kernels.block_codecs): decoding is
exactly gguf-py's; Q5_0 / Q5_1 encode to gguf-py's bytes; the K-quant quantizers' error is no
worse than llama-quantize's on the same weights (tests/data/kquants-llama-quantize.npz: `source`,
rows 0..63 of a random token_embd [4096, 256], and `q4_k`, `q5_k`, `q6_k`, the bytes
llama-quantize (llama.cpp build 10472) wrote for them in Q4_K_M / Q5_K_M / Q6_K files)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from quant_blocks import K_QUANTS, random_blocks

from pyruntime.kernels.block_codecs import BLOCKS, decode, encode

DATA = Path(__file__).resolve().parent / "data" / "kquants-llama-quantize.npz"
QTYPES = {"q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
# Our RMSE / llama-quantize's on the reference rows: measured 1.005 (Q4_K), 0.993 (Q5_K),
# 0.999 (Q6_K) there and on two other tensors of that model; a quantizer that skips the scale
# search (one min/max grid per sub-block, -max/32 for Q6_K) measures 1.06 .. 1.10.
RMSE_RATIO_TOL = 1.02


@pytest.mark.parametrize("fmt", list(BLOCKS))
def test_encode_decode_round_trip_against_gguf(fmt):
    """Odd row count, several blocks a row: decode(encode(x)) is gguf-py's dequantization of the
    same bytes, and close to x."""
    elems = BLOCKS[fmt][0]
    x = torch.randn(7, 3 * elems, generator=torch.Generator().manual_seed(1)) * 0.3
    raw = encode(x, fmt)
    assert raw.dtype == torch.uint8 and raw.shape == (7, 3 * BLOCKS[fmt][1])
    ref = quants.dequantize(raw.numpy(), QTYPES[fmt])
    assert np.array_equal(decode(raw, fmt, 3 * elems).numpy(), ref)
    rel = float((torch.from_numpy(ref) - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
    assert rel < {"q4_k": 0.1, "q6_k": 0.03}.get(fmt, 0.06), rel


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1"])
def test_legacy_encoders_are_ggmls(fmt):
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    x[3] = 0.0  # an all-zero block: scale 0, no NaN
    want = quants.quantize(x.numpy(), QTYPES[fmt])
    assert np.array_equal(encode(x, fmt).numpy(), want)


@pytest.mark.parametrize("qtype", list(K_QUANTS.values()))
def test_k_decoders_on_every_bit_pattern(qtype):
    raw = random_blocks(qtype, 5, 512, np.random.default_rng(4), scale=1.0)
    fmt = qtype.name.lower()
    got = decode(torch.from_numpy(raw), fmt, 512).numpy()
    assert np.array_equal(got, quants.dequantize(raw, qtype))


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_k_quantizers_no_worse_than_llama_quantize(fmt):
    data = np.load(DATA)
    x = data["source"]
    theirs = quants.dequantize(data[fmt], QTYPES[fmt]).reshape(x.shape)
    ours = decode(encode(torch.from_numpy(x), fmt), fmt, 256).numpy()
    ratio = np.sqrt(((ours - x) ** 2).mean()) / np.sqrt(((theirs - x) ** 2).mean())
    assert ratio <= RMSE_RATIO_TOL, f"{fmt}: RMSE {ratio:.4f} x llama-quantize's"


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_k_quantizers_on_flat_and_zero_rows(fmt):
    """All-zero and constant super-blocks, and one huge outlier: finite, and exact where the
    format can be (zeros)."""
    x = torch.zeros(3, 256)
    x[1] = 0.25
    x[2, 17] = 1e4
    back = decode(encode(x, fmt), fmt, 256)
    assert torch.isfinite(back).all()
    assert torch.equal(back[0], x[0])
    assert (back[1] - 0.25).abs().max() < 0.25 * 0.05
    assert (back[2, 17] - 1e4).abs() < 1e4 * 0.05
