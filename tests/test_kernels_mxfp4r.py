"""mxfp4r, the repacked MXFP4 expert rows (kernels.expert_formats): its layout, and every
expert path on it against the torch reference and against the GGUF MXFP4 rows it came from."""

import pytest
import torch

from pyruntime.kernels.dispatch import prepare_experts
from pyruntime.kernels.expert_formats import (
    dequantize_rows,
    format_family,
    quantize_rows,
    repack_rows,
    row_bytes,
)
from pyruntime.kernels.launch import interpreting
from pyruntime.kernels.moe_dense import moe_dense, moe_dense_ref
from pyruntime.kernels.moe_sparse import moe_gate_ref, moe_sparse, moe_sparse_ref
from pyruntime.kernels.testing import assert_close_rel, gap_threshold, make_bias, make_case

# gpt-oss-like rows at the interpreter's scale: 9 blocks (not a power of two), 153 bytes a row
# (padded to 160: rows 16-byte aligned, as 1530 -> 1536 at n_embd 2880)
N_EMBD = 288


def test_mxfp4r_rows_hold_the_gguf_bytes_regrouped_and_padded():
    """Per row: every block's 16 nibble bytes in block order, then every block's E8M0 byte,
    then zeros up to a multiple of 16 bytes; the reference dequantizer gives the GGUF values."""
    torch.manual_seed(3)
    w = torch.randn(4, 3, N_EMBD) * torch.rand(4, 3, 1) * 3
    w[0, 0, :32] = 0.0  # an all-zero block (E8M0 0)
    gguf = quantize_rows(w, "mxfp4")
    packed = repack_rows(gguf, "mxfp4")
    assert row_bytes("mxfp4", N_EMBD) == 153 and row_bytes("mxfp4r", N_EMBD) == 160
    assert row_bytes("mxfp4r", 2880) == 1536 and row_bytes("mxfp4r", 2048) == 1088
    assert packed.shape == (4, 3, 160) and packed.dtype == torch.uint8
    blocks = gguf.reshape(4, 3, 9, 17)
    assert torch.equal(packed[..., :144], blocks[..., 1:].reshape(4, 3, -1))
    assert torch.equal(packed[..., 144:153], blocks[..., 0])
    assert not packed[..., 153:].any()
    assert torch.equal(quantize_rows(w, "mxfp4r"), packed)
    assert torch.equal(dequantize_rows(packed, "mxfp4r", N_EMBD),
                       dequantize_rows(gguf, "mxfp4", N_EMBD))  # fmt: skip
    assert format_family("mxfp4r") == "packed"


def test_prepare_experts_repacks_mxfp4():
    w = quantize_rows(torch.randn(3, 7, 3, N_EMBD), "mxfp4")
    wk, fmt = prepare_experts(w, "mxfp4", N_EMBD)
    assert fmt == "mxfp4r" and wk.shape == (3, 7, 3, 160)
    assert torch.equal(wk, repack_rows(w, "mxfp4"))


def same_as_gguf(y: torch.Tensor, y_gguf: torch.Tensor) -> None:
    """mxfp4r decodes to the same values as MXFP4 and the kernels sum them in the same order:
    the same bits in the interpreter (on a GPU the order of the atomic adds into y varies from
    run to run, so there only fp32 rounding apart)."""
    if interpreting():
        assert torch.equal(y, y_gguf)
    else:
        assert_close_rel(y, y_gguf, 1e-6)


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("n_tok", [1, 5])
def test_mxfp4r_dense_biased_swiglu_oai(n_tok, path):
    x, w, ids, tw = make_case("mxfp4r", n_tok, seed=50 + n_tok, n_embd=N_EMBD)
    w_gguf = make_case("mxfp4", n_tok, seed=50 + n_tok, n_embd=N_EMBD)[1]
    bias = make_bias(N_EMBD, seed=50)
    y = moe_dense(x, w, "mxfp4r", ids, tw, "swiglu_oai", path=path, bias=bias)
    ref = moe_dense_ref(x, w, "mxfp4r", ids, tw, "swiglu_oai", bias=bias)
    assert_close_rel(y, ref, 1e-5)
    same_as_gguf(y, moe_dense(x, w_gguf, "mxfp4", ids, tw, "swiglu_oai", path=path, bias=bias))


@pytest.mark.parametrize(("path", "n_tok"), [("fused", 1), ("gemv_mask", 3), ("gemm_mask", 5)])
def test_mxfp4r_sparse(path, n_tok):
    """The sparse paths (biases on "fused", the one that takes them)."""
    x, w, ids, tw = make_case("mxfp4r", n_tok, seed=60 + n_tok, n_embd=N_EMBD)
    w_gguf = make_case("mxfp4", n_tok, seed=60 + n_tok, n_embd=N_EMBD)[1]
    bias = make_bias(N_EMBD, seed=60) if path == "fused" else None
    act = "swiglu_oai" if path == "fused" else "silu"
    gates = moe_gate_ref(x, w, "mxfp4r", ids)
    if bias is not None:
        gates = gates + bias[0][ids.long(), :, 0]
    thr = gap_threshold(gates, act, 0.6)
    y, count = moe_sparse(x, w, "mxfp4r", ids, tw, thr, act, path=path, bias=bias)
    ref, ref_count = moe_sparse_ref(x, w, "mxfp4r", ids, tw, thr, act, bias=bias)
    assert torch.equal(count, ref_count)
    assert 0 < int(count.sum()) < count.numel() * w.shape[1]  # it did skip some, not all
    assert_close_rel(y, ref, 1e-5)
    y_gguf, _ = moe_sparse(x, w_gguf, "mxfp4", ids, tw, thr, act, path=path, bias=bias)
    same_as_gguf(y, y_gguf)
