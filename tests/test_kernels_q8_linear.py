"""kernels.q8_linear: the Q8_0 dense GEMV vs plain torch over the dequantized weights."""

import os

import pytest
import torch

from pyruntime.gguf.quant import dequantize
from pyruntime.kernels.expert_formats import quantize_rows
from pyruntime.kernels.q8_linear import (
    add_norm_q8_gemv,
    add_norm_q8_linear_ref,
    dequantize_q8,
    q8_gemv,
    q8_linear_ref,
    split_q8_0,
)

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


@pytest.mark.parametrize("T, N, K", [(1, 37, 96), (2, 70, 288)])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_add_norm_q8_gemv_matches_reference(T, N, K, with_delta, with_bias):
    g = torch.Generator().manual_seed(T * N + K + with_delta)
    q, d = split_q8_0(quantize_rows(torch.randn(N, K, generator=g) * K**-0.5, "q8_0"), K)
    x = torch.randn(T, K, generator=g) * 3
    delta = torch.randn(T, K, generator=g).to(torch.bfloat16) if with_delta else None
    norm_w = torch.rand(K, generator=g) + 0.5
    bias = torch.randn(N, generator=g) if with_bias else None
    dev = [None if t is None else t.to(DEV) for t in (x, delta, norm_w, q, d, bias)]
    x1, y = add_norm_q8_gemv(dev[0], dev[1], dev[2], 1e-5, *dev[3:], out_dtype=torch.float32,
                             alpha=0.5)  # fmt: skip
    ref_x1, ref = add_norm_q8_linear_ref(x, delta, norm_w, 1e-5, q, d, bias, alpha=0.5)
    assert torch.allclose(x1.cpu(), ref_x1, rtol=1e-6, atol=1e-6)
    # fp32 throughout: summation order only.
    assert (y.cpu() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
