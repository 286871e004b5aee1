"""The torch codecs of kernels.expert_formats against gguf.quants (the reference codecs)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.expert_formats import dequantize_rows, quantize_rows, row_bytes

QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
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


def test_row_bytes_and_errors():
    assert row_bytes("q8_0", 2048) == 2176
    assert row_bytes("q4_0", 2048) == 1152
    assert row_bytes("bf16", 100) == 200
    with pytest.raises(ValueError, match="n_embd % 32"):
        row_bytes("q8_0", 100)
    with pytest.raises(ValueError, match="unknown expert weight format"):
        row_bytes("q5_k", 64)
