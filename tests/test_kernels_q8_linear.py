"""kernels.q8_linear: the Q8_0 dense GEMV vs plain torch over the dequantized weights."""

import pytest
import torch
from gpu_device import DEVICE as DEV

from pyruntime.gguf.quant import dequantize
from pyruntime.kernels.expert_formats import quantize_rows
from pyruntime.kernels.q8_linear import (
    dequantize_q8,
    q4_0_as_q8_0,
    q8_gemv,
    q8_linear_ref,
    split_q8_0,
)


def test_split_matches_gguf_dequantization():
    from gguf import GGMLQuantizationType

    w = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    raw = quantize_rows(w, "q8_0")  # GGUF bytes [5, 102]
    q, d = split_q8_0(raw, 96)
    ref = dequantize(raw.numpy(), GGMLQuantizationType.Q8_0, (5, 96))
    assert torch.equal(dequantize_q8(q, d, torch.float32), ref)


def test_q4_0_as_q8_0_is_exact():
    """Q4_0 rows repacked for the Q8_0 kernels hold the GGUF's Q4_0 weights exactly (every
    nibble code, both halves of a block, random f16 scales)."""
    from gguf import GGMLQuantizationType

    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (7, 96 // 32, 18), generator=g, dtype=torch.uint8)
    raw[:, :, :2] = (torch.rand(7, 3, generator=g) + 0.1).half().view(torch.uint8).reshape(7, 3, 2)
    raw = raw.reshape(7, -1)
    q, d = q4_0_as_q8_0(raw, 96)
    ref = dequantize(raw.numpy(), GGMLQuantizationType.Q4_0, (7, 96))
    assert q.dtype == torch.int8 and int(q.min()) == -8 and int(q.max()) == 7
    assert torch.equal(dequantize_q8(q, d, torch.float32), ref)
    with pytest.raises(ValueError, match="Q4_0 rows of 96 weights are 54 bytes"):
        q4_0_as_q8_0(raw[:, :50], 96)


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


# M not a multiple of the row tile (1, 7, 33, 300 tokens), N not of the column tile, K a
# multiple of 32 but not of the K tile (96 = 64 + 32).
@pytest.mark.parametrize("M", [1, 7, 33, 300])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", ["default", "gpu"])
def test_q8_gemm_matches_reference(M, x_dtype, config):
    """The prefill GEMM (W tiles dequantized in registers) vs x @ dequantize(W)^T in fp32, with
    a bias, x rows at a stride (a slice of a wider tensor), bf16 out. On a GPU half x runs on
    tensor cores: W rounded to the dot dtype (2^-9 relative for bf16) and the bf16 output
    (2^-9): 1e-2 of max |ref|, as the grouped expert GEMMs; fp32 dots: summation order only
    (and the bf16 output's rounding, 2^-8 relative). config "gpu": the GPU's tiles for M
    (here under the interpreter too)."""
    from pyruntime.kernels.q8_linear import GEMM_CONFIGS, q8_gemm

    N, K = 70, 96
    g = torch.Generator().manual_seed(M)
    q, d = split_q8_0(quantize_rows(torch.randn(N, K, generator=g) * K**-0.5, "q8_0"), K)
    wide = torch.randn(M, K + 32, generator=g).to(x_dtype)
    bias = torch.randn(N, generator=g)
    cfg = None if config == "default" else GEMM_CONFIGS["short" if M <= 64 else "long"]
    x = wide.to(DEV)[:, :K]
    y = q8_gemm(x, q.to(DEV), d.to(DEV), bias.to(DEV), out_dtype=torch.bfloat16, config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    ref = q8_linear_ref(wide[:, :K], q, d, bias)
    half_dots = DEV == "cuda" and x_dtype != torch.float32
    tol = 1e-2 if half_dots else 2**-8  # the bf16 output's rounding
    assert (y.float().cpu() - ref).abs().max().item() <= tol * ref.abs().max().item()
