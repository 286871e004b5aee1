"""kernels.moe_q4r_pipe ("q4r_pipe": the dense dp4a decode kernel over q4_0r / mxfp4r experts)
against the torch reference on the same Q8-quantized x, and its place in the path table."""

import pytest
import torch

from pyruntime.kernels.dispatch import moe_experts
from pyruntime.kernels.expert_paths import quantizes_x, table_path
from pyruntime.kernels.moe_dense import DENSE_LAUNCHERS, moe_dense, moe_dense_ref
from pyruntime.kernels.moe_q4r_pipe import moe_q4r_pipe, row_pieces
from pyruntime.kernels.testing import (
    DEVICE,
    N_EXPERT,
    assert_close_rel,
    make_bias,
    make_case,
    spy_tokens,
)

FORMATS = ["q4_0r", "mxfp4r"]
# 9 blocks (not a power of two: pieces of 8 + 1 blocks; q4_0r rows of 162 bytes, 2-byte
# aligned: 16-bit word loads), 6 blocks (4 + 2; q4_0r rows 4-byte aligned)
N_EMBDS = [288, 192]
# fp32 sums of exact integer block dots: summation-order rounding only
RTOL = 1e-5


def programs(blocks):
    """(BLOCK_N, num_warps, programs): the interpreter's grid is `programs`, a GPU's per SM."""
    if blocks is not None and DEVICE.type == "cuda":
        blocks = (*blocks[:2], max(1, blocks[2] // 100))
    return blocks


def check(fmt, n_tok, n_embd, activation, with_bias, seed, blocks=None, in_kernel=None):
    x, w, ids, tw = make_case(fmt, n_tok, torch.bfloat16, seed=seed, n_embd=n_embd)
    bias = make_bias(n_embd, seed=seed) if with_bias else None
    y = moe_q4r_pipe(x, w, fmt, ids, tw, activation, bias=bias, blocks=programs(blocks),
                     quantize_in_kernel=in_kernel)  # fmt: skip
    assert y.shape == x.shape and y.dtype == torch.float32
    ref = moe_dense_ref(x, w, fmt, ids, tw, activation, q8_x=True, bias=bias)
    assert_close_rel(y, ref, RTOL)


# one program over every tile (pair changes mid-run), a few, one tile each
@pytest.mark.parametrize("blocks", [None, (4, 4, 1), (2, 4, 5), (16, 4, 1000)])
@pytest.mark.parametrize("n_embd", N_EMBDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_q4r_pipe_biased_swiglu_oai(fmt, n_embd, blocks):
    """gpt-oss's layer: gate/up biases in the tile arithmetic, each pair's down bias added by
    exactly one program whatever the cut of the tiles."""
    check(fmt, 1, n_embd, "swiglu_oai", True, seed=len(fmt) + n_embd, blocks=blocks)


@pytest.mark.parametrize(("n_tok", "in_kernel"), [(1, True), (1, False), (3, False)])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("n_embd", N_EMBDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_q4r_pipe_matches_reference(fmt, n_embd, activation, n_tok, in_kernel):
    """x quantized inside the kernel (one token) or by quantize_x_q8 first."""
    check(fmt, n_tok, n_embd, activation, False, seed=7 * n_tok + n_embd, in_kernel=in_kernel)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_q4r_pipe_gpt_oss_width(fmt, with_bias):
    """n_embd 2880 (gpt-oss-20b): 90 blocks in a padded 128."""
    act = "swiglu_oai" if with_bias else "silu"
    check(fmt, 1, 2880, act, with_bias, seed=11, blocks=(16, 4, 3))


def test_row_pieces_cover_the_row_with_two_powers_of_two():
    assert row_pieces(90) == (64, 32)  # gpt-oss-20b: 96 blocks' lanes, not 128
    assert row_pieces(64) == (64, 0)  # qwen3.5, n_embd 2048: one piece
    assert [row_pieces(nb) for nb in (1, 5, 6, 9)] == [(1, 0), (4, 1), (4, 2), (8, 1)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_q4r_pipe_one_block_second_piece_several_rows_a_tile(fmt):
    """n_embd 160: pieces of 4 + 1 blocks; 8 neurons a tile over 3 tokens (rows summed per pair
    run, not per tile)."""
    check(fmt, 3, 160, "swiglu_oai", True, seed=5, blocks=(8, 4, 4))


@pytest.mark.parametrize("fmt", FORMATS)
def test_q4r_pipe_expert_map_with_biases(fmt):
    """Complementary expert maps over compact tensors: each pair's result (down bias included)
    comes from the map holding its expert, none from the other; the halves add up."""
    x, w, ids, tw = make_case(fmt, 2, torch.bfloat16, seed=31, n_embd=288)
    bias = make_bias(288, seed=31)
    full = moe_dense_ref(x, w, fmt, ids, tw, "swiglu_oai", q8_x=True, bias=bias)
    total = torch.zeros_like(full)
    for experts in ([3, 0, 2], [5, 1, 4]):
        emap = torch.full((N_EXPERT,), -1, dtype=torch.int32)
        emap[experts] = torch.arange(3, dtype=torch.int32)
        ws, emap = w[experts].contiguous(), emap.to(DEVICE)
        y = moe_dense(x, ws, fmt, ids, tw, "swiglu_oai", path="q4r_pipe", expert_map=emap,
                      bias=bias)  # fmt: skip
        here = torch.isin(ids.long(), torch.tensor(experts, device=ids.device))
        ref = moe_dense_ref(x, w, fmt, ids, tw * here, "swiglu_oai", q8_x=True, bias=bias)
        assert_close_rel(y, ref, RTOL)
        total += y
    assert_close_rel(total, full, RTOL)


def test_table_takes_q4r_pipe_for_4bit_experts_up_to_8_tokens():
    """The 4-bit repacked formats up to 8 tokens, biases and swiglu_oai included; the grouped
    GEMMs above, and the sparse rows as before (biases: "fused")."""
    for fmt in FORMATS:
        for generic in (False, True):
            got = [table_path(fmt, 2880, t, sparse=False, generic=generic) for t in (1, 2, 8, 9)]
            assert got == ["q4r_pipe", "q4r_pipe", "q4r_pipe", "gemm"]
            assert table_path(fmt, 2880, 1, sparse=True, generic=generic) == "fused"
    assert table_path("q4_0r", 288, 1, sparse=False) == "q4r_pipe"
    assert table_path("q4_0", 2048, 1, sparse=False) == "gemv"  # not repacked
    assert table_path("q8_0r", 2048, 1, sparse=False, generic=True) == "gemv"
    assert quantizes_x("q4r_pipe") and not quantizes_x("gemv")


def test_moe_experts_runs_gpt_oss_decode_on_q4r_pipe(monkeypatch):
    calls = spy_tokens(monkeypatch, DENSE_LAUNCHERS, "q4r_pipe")
    x, w, ids, tw = make_case("mxfp4r", 1, torch.bfloat16, seed=41, n_embd=288)
    bias = make_bias(288, seed=41)
    y, active = moe_experts(x, w, "mxfp4r", ids, tw, "swiglu_oai", bias=bias)
    assert calls == [1] and active is None
    assert_close_rel(y, moe_dense_ref(x, w, "mxfp4r", ids, tw, "swiglu_oai", q8_x=True,
                                      bias=bias), RTOL)  # fmt: skip


def test_q4r_pipe_refuses_other_formats_and_in_kernel_x_above_one_token():
    x, w, ids, tw = make_case("q8_0r", 1, n_embd=192)
    with pytest.raises(ValueError, match="q4_0r or mxfp4r"):
        moe_q4r_pipe(x, w, "q8_0r", ids, tw)
    x, w, ids, tw = make_case("q4_0r", 2, n_embd=192)
    with pytest.raises(ValueError, match="1 token"):
        moe_q4r_pipe(x, w, "q4_0r", ids, tw, quantize_in_kernel=True)
