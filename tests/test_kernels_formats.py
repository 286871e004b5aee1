"""The torch codecs of kernels.expert_formats against gguf.quants (the reference codecs)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pyruntime.kernels.dispatch import prepare_experts
from pyruntime.kernels.expert_formats import dequantize_rows, quantize_rows, repack_rows, row_bytes

QTYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "mxfp4": GGMLQuantizationType.MXFP4,
}


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "mxfp4"])
def test_quantize_matches_gguf(fmt):
    torch.manual_seed(0)
    w = torch.randn(7, 3, 96) * torch.rand(7, 3, 1) * 3  # rows of different scales
    w[0, 0, :32] = 0.0  # an all-zero block (d = 0)
    ours = quantize_rows(w, fmt)
    ref = quantize(w.numpy(), QTYPES[fmt])
    assert ours.shape == (7, 3, row_bytes(fmt, 96))
    np.testing.assert_array_equal(ours.numpy(), ref)
    back = dequantize_rows(ours, fmt, 96)
    np.testing.assert_array_equal(back.numpy(), dequantize(ref, QTYPES[fmt]))


@pytest.mark.parametrize(("fmt", "quant_bytes"), [("q8_0", 32), ("q4_0", 16)])
def test_repacked_rows_hold_the_same_bytes_regrouped(fmt, quant_bytes):
    """q8_0r / q4_0r: per row, every block's quants in block order, then every block's f16
    scale; the reference dequantizer gives exactly the GGUF values."""
    torch.manual_seed(1)
    w = torch.randn(5, 3, 160) * torch.rand(5, 3, 1) * 3
    gguf = quantize_rows(w, fmt)
    packed = repack_rows(gguf, fmt)
    assert packed.shape == gguf.shape and packed.dtype == torch.uint8
    blocks = gguf.reshape(5, 3, 5, 2 + quant_bytes)  # 5 blocks of 32 per row
    assert torch.equal(packed[..., : 5 * quant_bytes], blocks[..., 2:].reshape(5, 3, -1))
    assert torch.equal(packed[..., 5 * quant_bytes :], blocks[..., :2].reshape(5, 3, -1))
    assert torch.equal(quantize_rows(w, fmt + "r"), packed)
    want = dequantize_rows(gguf, fmt, 160)
    assert torch.equal(dequantize_rows(packed, fmt + "r", 160), want)
    assert torch.equal(sorted_bytes(packed), sorted_bytes(gguf))  # a permutation of the bytes


def sorted_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sort(dim=1).values


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "bf16"])
def test_prepare_experts_repacks_block_formats_only(fmt):
    w = quantize_rows(torch.randn(3, 7, 3, 64), fmt)
    wk, fmt_k = prepare_experts(w, fmt, 64)
    if fmt == "bf16":
        assert fmt_k == "bf16" and wk is w
    else:
        assert fmt_k == fmt + "r"
        assert torch.equal(wk, repack_rows(w, fmt))
    with pytest.raises(ValueError, match="expert tensor"):
        prepare_experts(w[:, :, :2].contiguous(), fmt, 64)


def test_row_bytes_and_errors():
    assert row_bytes("q8_0", 2048) == 2176
    assert row_bytes("q4_0", 2048) == 1152
    assert row_bytes("q8_0r", 2048) == 2176 and row_bytes("q4_0r", 2048) == 1152
    assert row_bytes("bf16", 100) == 200
    with pytest.raises(ValueError, match="n_embd % 32"):
        row_bytes("q8_0", 100)
    assert row_bytes("q5_0", 96) == 66 and row_bytes("q4_k", 512) == 288
    with pytest.raises(ValueError, match="n_embd % 256"):
        row_bytes("q5_k", 64)  # K-quant rows are whole super-blocks
    with pytest.raises(ValueError, match="unknown expert weight format"):
        row_bytes("iq4_nl", 64)
