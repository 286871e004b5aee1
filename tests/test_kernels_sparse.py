"""Activation sparsity: mask/compaction kernel, gate dots, sparse up-down and moe_sparse."""

import pytest
import torch

from pyruntime.kernels.expert_formats import act_ref, quantize_x_q8_ref
from pyruntime.kernels.expert_paths import quantizes_x, table_path
from pyruntime.kernels.moe_dense import moe_dense, moe_dense_ref
from pyruntime.kernels.moe_q8r import moe_q8r_sparse, moe_q8r_sparse2
from pyruntime.kernels.moe_sparse import (
    SPARSE_LAUNCHERS,
    moe_gate,
    moe_gate_ref,
    moe_sparse,
    moe_sparse_fused,
    moe_sparse_ref,
    moe_sparse_split,
    moe_sparse_up_down,
)
from pyruntime.kernels.sparse_mask import sparse_mask, sparse_mask_ref
from pyruntime.kernels.testing import (
    DEVICE,
    Q8R_N_EMBD,
    assert_close_rel,
    gap_threshold,
    make_bias,
    make_case,
    rtol_for,
    spy_tokens,
)

FORMATS = ["f16", "bf16", "q8_0", "q4_0", "q8_0r", "q4_0r", "mxfp4", "mxfp4r"]
# The 5-bit and K-quant formats (llama.cpp's Q4_K_M / Q5_K_M / Q6_K files) read through the Q8_0
# family's block path (kernels.expert_rows.q8_blocks): each in the gate and up-down kernels, two
# of them (an offset format, a K-quant) in every sparse path; moe_dense's tests take all five.
NEW_FORMATS = ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


def gate_away_from(threshold: float, shape, activation: str, margin: float = 1e-3, seed=0):
    """Random gate values none of whose |act| lies within `margin` of the threshold."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2
    for _ in range(100):
        near = (act_ref(g.double(), activation).abs() - threshold).abs() < margin
        if not near.any():
            return g
        g[near] = torch.randn(int(near.sum())) * 2
    raise AssertionError("could not draw gate values away from the threshold")


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize(("n_pairs", "n_ff", "block"), [(1, 45, None), (7, 300, 64), (51, 45, 16)])
def test_sparse_mask_keeps_exactly_the_right_neurons(n_pairs, n_ff, block, activation):
    thr = 0.3
    gate = gate_away_from(thr, (n_pairs, n_ff), activation, seed=n_ff).to(DEVICE)
    idx, act, count = sparse_mask(gate, thr, activation, block=block)
    ref_idx, ref_act, ref_count = sparse_mask_ref(gate, thr, activation)
    assert torch.equal(count, ref_count)
    assert 0 < int(count.sum()) < gate.numel()  # the case does mask something, not everything
    for p in range(n_pairs):
        c = int(count[p])
        assert torch.equal(idx[p, :c], ref_idx[p, :c])  # same neurons, increasing order
        torch.testing.assert_close(act[p, :c], ref_act[p, :c], rtol=1e-6, atol=1e-6)


def test_sparse_mask_threshold_zero_keeps_all_and_huge_keeps_none():
    gate = torch.randn(5, 45).to(DEVICE)
    idx, _, count = sparse_mask(gate, 0.0)
    assert (count == 45).all() and torch.equal(
        idx, torch.arange(45, dtype=torch.int32, device=DEVICE).expand(5, 45)
    )
    _, _, count = sparse_mask(
        gate, torch.tensor([1e30], device=DEVICE)
    )  # a device-tensor threshold
    assert (count == 0).all()


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("fmt", FORMATS + NEW_FORMATS)
def test_moe_gate_matches_reference(fmt, path):
    x, w, ids, tw = make_case(fmt, 3, seed=11)
    gate = moe_gate(x, w, fmt, ids, path=path)
    assert_close_rel(gate, moe_gate_ref(x, w, fmt, ids), 1e-5)


@pytest.mark.parametrize("fmt", FORMATS + NEW_FORMATS)
def test_sparse_up_down_matches_reference(fmt):
    """Up-down alone, on the reference mask: only the active neurons contribute."""
    x, w, ids, tw = make_case(fmt, 3, seed=12)
    gate = moe_gate_ref(x, w, fmt, ids)
    thr = gap_threshold(gate, "silu", 0.6)
    idx, act, count = sparse_mask_ref(gate, thr, "silu")
    y = moe_sparse_up_down(x, w, fmt, ids, tw, idx, act, count, block_n=16)
    ref, active = moe_sparse_ref(x, w, fmt, ids, tw, thr)
    assert torch.equal(count.view_as(active), active)
    assert_close_rel(y, ref, 1e-5)


@pytest.mark.parametrize("path", ["fused", "split", "gemv_mask", "gemm_mask"])
@pytest.mark.parametrize("n_tok", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_sparse_threshold_zero_equals_dense(fmt, n_tok, path):
    x_dtype = torch.bfloat16 if n_tok == 3 else torch.float32
    x, w, ids, tw = make_case(fmt, n_tok, x_dtype, seed=20 + n_tok)
    y, active = moe_sparse(x, w, fmt, ids, tw, 0.0, path=path)
    assert (active == w.shape[1]).all()
    dense_path = "gemm" if path == "gemm_mask" else "gemv"
    assert_close_rel(y, moe_dense(x, w, fmt, ids, tw, path=dense_path), rtol_for(x_dtype))


# every format with silu; gelu on one float and one block format
FMT_ACT = [(f, "silu") for f in [*FORMATS, "q5_1", "q4_k"]] + [
    ("bf16", "gelu"),
    ("q4_0", "gelu"),
    ("q4_0r", "gelu"),
]


@pytest.mark.parametrize("path", ["fused", "split", "gemv_mask", "gemm_mask"])
@pytest.mark.parametrize("n_tok", [1, 17])
@pytest.mark.parametrize(("fmt", "activation"), FMT_ACT)
def test_moe_sparse_matches_reference(fmt, activation, n_tok, path):
    x, w, ids, tw = make_case(fmt, n_tok, seed=30 + n_tok)
    thr = gap_threshold(moe_gate_ref(x, w, fmt, ids), activation, 0.7)
    y, active = moe_sparse(x, w, fmt, ids, tw, thr, activation, path=path)
    ref, ref_active = moe_sparse_ref(x, w, fmt, ids, tw, thr, activation)
    assert torch.equal(active, ref_active)
    assert 0.5 < 1 - active.sum() / active.numel() / w.shape[1] < 0.9  # it did skip ~70%
    assert_close_rel(y, ref, 1e-5)


@pytest.mark.parametrize("path", ["fused", "split", "gemv_mask"])
def test_moe_sparse_all_tiles_empty(path):
    """Every tile exits early: y is exactly 0 and the counts are 0."""
    x, w, ids, tw = make_case("q8_0", 3, seed=40)
    y, active = moe_sparse(x, w, "q8_0", ids, tw, 1e30, path=path)
    assert (active == 0).all() and (y == 0).all()


@pytest.mark.parametrize("acc2d", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0", "q8_0r", "q4_0r"])
def test_moe_sparse_fused_small_tiles(fmt, acc2d):
    """GPU-sized tiles (8 neurons, 64-element chunks): per-tile counts match the reference
    mask, all-inactive tiles skip their up/down rows, and y matches the reference."""
    x, w, ids, tw = make_case(fmt, 3, seed=41)
    gate = moe_gate_ref(x, w, fmt, ids)
    thr = gap_threshold(gate, "silu", 0.8)
    y, count = moe_sparse_fused(x, w, fmt, ids, tw, thr, blocks=(8, 64, 4, acc2d))
    keep = act_ref(gate, "silu").abs() >= thr  # [P, 45]
    padded = torch.nn.functional.pad(keep, (0, 3)).view(keep.shape[0], 6, 8)  # 6 tiles of 8
    assert (padded.sum(dim=2) == 0).any()  # some tiles are empty and exit after the gate
    assert torch.equal(count, keep.sum(dim=1).to(torch.int32))  # tiles' counts added per pair
    assert_close_rel(y, moe_sparse_ref(x, w, fmt, ids, tw, thr)[0], 1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0", "q8_0r", "q4_0r"])
def test_moe_sparse_split_small_blocks(fmt):
    """GPU-sized blocks: 8-neuron gate-up tiles; down steps of 16 neurons, 32-column chunks,
    slices of 48 (pair, neuron) rows that straddle pairs; counts and y match the reference."""
    x, w, ids, tw = make_case(fmt, 2, seed=42)
    gate = moe_gate_ref(x, w, fmt, ids)
    thr = gap_threshold(gate, "silu", 0.8)
    y, count = moe_sparse_split(x, w, fmt, ids, tw, thr, blocks=(8, 64, 4, True),
                                down=(16, 32, 48, 4))  # fmt: skip
    ref, ref_active = moe_sparse_ref(x, w, fmt, ids, tw, thr)
    assert torch.equal(count.view(ref_active.shape), ref_active)
    assert_close_rel(y, ref, 1e-5)


# the q8r path: q8_0r experts with n_embd % 64 == 0 (make_case(..., n_embd=Q8R_N_EMBD))


@pytest.mark.parametrize("dp4a", [False, True])
@pytest.mark.parametrize("blocks", [None, (16, 4, 4), (8, 2, 4), (4, 1, 2)])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_moe_sparse_q8r_matches_reference(n_tok, blocks, dp4a):
    """Kept neurons compacted in registers and processed BA at a time (several steps per
    program at 30% kept of up to 64 neurons), one or several neuron tiles per pair; gate/up
    dots on x or (dp4a) on Q8-quantized x against the reference on the same x, the threshold
    in a gap of those gates."""
    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=50 + n_tok, n_embd=Q8R_N_EMBD)
    xg = quantize_x_q8_ref(x) if dp4a else x
    thr = gap_threshold(moe_gate_ref(xg, w, "q8_0r", ids), "silu", 0.7)
    y, active = moe_q8r_sparse(x, w, "q8_0r", ids, tw, thr, blocks=blocks, dp4a=dp4a)
    ref, ref_active = moe_sparse_ref(x, w, "q8_0r", ids, tw, thr, q8_x=dp4a)
    assert torch.equal(active.view(ref_active.shape), ref_active)
    assert 0.5 < 1 - active.sum() / active.numel() / w.shape[1] < 0.9
    assert_close_rel(y, ref, 1e-5)


def test_moe_sparse_auto_q8r_quantizes_x_as_reported():
    """The auto path on aligned q8_0r: x quantized exactly when quantizes_x() says so."""
    x, w, ids, tw = make_case("q8_0r", 2, torch.bfloat16, seed=57, n_embd=Q8R_N_EMBD)
    q8_x = quantizes_x(table_path("q8_0r", Q8R_N_EMBD, 2, sparse=True))
    xg = quantize_x_q8_ref(x) if q8_x else x
    thr = gap_threshold(moe_gate_ref(xg, w, "q8_0r", ids), "silu", 0.7)
    y, active = moe_sparse(x, w, "q8_0r", ids, tw, thr)
    ref, ref_active = moe_sparse_ref(x, w, "q8_0r", ids, tw, thr, q8_x=q8_x)
    assert torch.equal(active, ref_active)
    assert_close_rel(y, ref, 1e-5)


@pytest.mark.parametrize("n_tok", [1, 3])
def test_moe_sparse_q8r_threshold_zero_equals_dense_and_huge_is_empty(n_tok):
    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=60, n_embd=Q8R_N_EMBD)
    y, active = moe_sparse(x, w, "q8_0r", ids, tw, 0.0, path="q8r_sparse")
    assert (active == w.shape[1]).all()
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, q8_x=True), 1e-5)
    assert_close_rel(y, moe_dense(x, w, "q8_0r", ids, tw, path="q8r_pipe"), 1e-5)
    y, active = moe_sparse(x, w, "q8_0r", ids, tw, 1e30, path="q8r_sparse")
    assert (active == 0).all() and (y == 0).all()


def test_sparse_table_takes_q8r_for_aligned_q8_0r_at_small_batch():
    """kernels.expert_paths: the two-phase q8r kernel at one token, the one-wave one up to 16,
    then the generic paths; never q8r for other formats or unaligned rows."""
    got = [table_path("q8_0r", 2048, t, sparse=True) for t in (1, 2, 16, 17)]
    assert got == ["q8r_sparse2", "q8r_sparse", "q8r_sparse", "gemm_mask"]
    assert not quantizes_x(table_path("q8_0r", 96, 1, sparse=True))  # rows not 4-byte aligned
    assert not quantizes_x(table_path("q4_0r", 2048, 1, sparse=True))
    assert [table_path("q4_0r", 2048, t, sparse=True) for t in (4, 5, 16, 17)] == [
        "fused", "gemv_mask", "gemv_mask", "gemm_mask"
    ]  # fmt: skip


# (BLOCK_N, BK, num_warps, programs) of the two-phase experiment (the interpreter's grid is
# `programs`): one program over everything (pair changes inside both phases), a few, many
@pytest.mark.parametrize("blocks", [(8, 4, 4, 1), (4, 2, 4, 7), (2, 2, 4, 1000), (16, 1, 4, 3)])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_moe_q8r_sparse2_matches_reference(n_tok, blocks):
    """kernels.moe_dense.moe_q8r_sparse2: gate rows then the kept list's up/down rows per
    program; the same kept neurons (counts equal) and sum as the reference on quantized x."""
    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=70 + n_tok, n_embd=Q8R_N_EMBD)
    thr = gap_threshold(moe_gate_ref(quantize_x_q8_ref(x), w, "q8_0r", ids), "silu", 0.7)
    y, active = moe_q8r_sparse2(x, w, "q8_0r", ids, tw, thr, blocks=blocks)
    ref, ref_active = moe_sparse_ref(x, w, "q8_0r", ids, tw, thr, q8_x=True)
    assert torch.equal(active.view(ref_active.shape), ref_active)
    assert 0.5 < 1 - active.sum() / active.numel() / w.shape[1] < 0.9
    assert_close_rel(y, ref, 1e-5)
    y0, active0 = moe_q8r_sparse2(x, w, "q8_0r", ids, tw, 0.0, blocks=blocks)  # keeps all
    assert (active0 == w.shape[1]).all()
    assert_close_rel(y0, moe_dense_ref(x, w, "q8_0r", ids, tw, q8_x=True), 1e-5)


@pytest.mark.parametrize("n_tok", [1, 2])
def test_moe_sparse_takes_the_sparse2_kernel_at_one_token(n_tok, monkeypatch):
    """The dispatch: moe_sparse's auto path (q8r) calls moe_q8r_sparse2 at one token only,
    and matches the reference either way."""
    calls = spy_tokens(monkeypatch, SPARSE_LAUNCHERS, "q8r_sparse2")
    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=90 + n_tok, n_embd=Q8R_N_EMBD)
    thr = gap_threshold(moe_gate_ref(quantize_x_q8_ref(x), w, "q8_0r", ids), "silu", 0.7)
    y, active = moe_sparse(x, w, "q8_0r", ids, tw, thr)
    assert calls == ([1] if n_tok == 1 else [])
    ref, ref_active = moe_sparse_ref(x, w, "q8_0r", ids, tw, thr, q8_x=True)
    assert torch.equal(active.view(ref_active.shape), ref_active)
    assert_close_rel(y, ref, 1e-5)


@pytest.mark.parametrize("n_tok", [1, 17])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0r", "mxfp4", "mxfp4r"])
def test_moe_sparse_biased_swiglu_oai(fmt, n_tok):
    """gpt-oss's experts on the "fused" sparse path ("auto" takes it for biased layers): the
    threshold applies to |act(gate + gate bias)|; kept neurons and y as the reference."""
    x, w, ids, tw = make_case(fmt, n_tok, seed=13)
    bias = make_bias(x.shape[1], seed=13)
    H = x.shape[1]
    from pyruntime.kernels.moe_dense import dequantize_experts

    wf = dequantize_experts(w, fmt, H)
    gates = torch.einsum("tkfh,th->tkf", wf[ids.long(), :, 0], x.float())
    gates = gates + bias[0][ids.long(), :, 0]
    threshold = gap_threshold(gates, "swiglu_oai", 0.6)
    assert table_path(fmt, H, n_tok, sparse=True, generic=True) == "fused"
    y, count = moe_sparse(x, w, fmt, ids, tw, threshold, "swiglu_oai", bias=bias)
    ref, ref_count = moe_sparse_ref(x, w, fmt, ids, tw, threshold, "swiglu_oai", bias=bias)
    assert torch.equal(count.cpu(), ref_count.cpu())
    assert 0 < int(ref_count.sum()) < ids.numel() * wf.shape[1]
    assert_close_rel(y, ref, 1e-5)
