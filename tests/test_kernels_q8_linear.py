"""kernels.q8_linear: the Q8_0 dense GEMV vs plain torch over the dequantized weights."""

import os

import pytest
import torch

from pyruntime.gguf.quant import dequantize
from pyruntime.kernels.expert_formats import quantize_rows
from pyruntime.kernels.q8_linear import dequantize_q8, q8_gemv, q8_linear_ref, split_q8_0

DEV = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"


def test_split_matches_gguf_dequantization():
    from gguf import GGMLQuantizationType

    w = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    raw = quantize_rows(w, "q8_0")  # GGUF bytes [5, 102]
    q, d = split_q8_0(raw, 96)
    ref = dequantize(raw.numpy(), GGMLQuantizationType.Q8_0, (5, 96))
    assert torch.equal(dequantize_q8(q, d, torch.float32), ref)


# N rows not a multiple of the row tile; K a multiple of 32 but not of the K tile.
@pytest.mark.parametrize("T, N, K", [(1, 37, 96), (3, 70, 288), (1, 5, 32)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q8_gemv_matches_reference(T, N, K, x_dtype, with_bias):
    g = torch.Generator().manual_seed(T * N + K)
    q, d = split_q8_0(quantize_rows(torch.randn(N, K, generator=g) * K**-0.5, "q8_0"), K)
    x = torch.randn(T, K, generator=g).to(x_dtype)
    bias = torch.randn(N, generator=g) if with_bias else None
    y = q8_gemv(x.to(DEV), q.to(DEV), d.to(DEV), None if bias is None else bias.to(DEV),
                out_dtype=torch.float32).cpu()  # fmt: skip
    ref = q8_linear_ref(x, q, d, bias)
    # fp32 accumulation of exact products: summation order only.
    assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
