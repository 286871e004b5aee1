"""kernels.moe_dense (decode GEMV and prefill grouped GEMM) against the torch reference."""

import pytest
import torch

from kernels.moe_dense import moe_align, moe_dense, moe_dense_ref
from kernels.testing import (
    DEVICE,
    N_EXPERT,
    Q8R_N_EMBD,
    assert_close_rel,
    make_case,
    rtol_for,
)

FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q8_0r", "q4_0r"]


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("n_tok", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_dense_matches_reference(fmt, n_tok, path):
    x_dtype = torch.bfloat16 if n_tok == 3 else torch.float32
    x, w, ids, tw = make_case(fmt, n_tok, x_dtype, seed=n_tok)
    y = moe_dense(x, w, fmt, ids, tw, path=path)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw), rtol_for(x_dtype))


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("fmt", ["bf16", "q4_0", "q4_0r"])
def test_moe_dense_gelu(fmt, path):
    x, w, ids, tw = make_case(fmt, 3, seed=5)
    y = moe_dense(x, w, fmt, ids, tw, activation="gelu", path=path)
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw, activation="gelu"), 1e-5)


@pytest.mark.parametrize("acc2d", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q8_0r", "q4_0r"])
def test_moe_dense_small_blocks_decode(fmt, acc2d):
    """Several neuron tiles and H chunks per program (the GPU block sizes, not the big ones),
    with per-chunk reductions or elementwise accumulation (ACC2D)."""
    from kernels.moe_dense import moe_dense_decode

    x, w, ids, tw = make_case(fmt, 3, seed=7)
    y = moe_dense_decode(x, w, fmt, ids, tw, blocks=(16, 32, 4, acc2d))
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw), 1e-5)


def test_moe_align_groups_pairs_by_expert():
    torch.manual_seed(0)
    ids = torch.randint(0, N_EXPERT, (17, 3), dtype=torch.int32).to(DEVICE)
    bm = 4
    sorted_pairs, block_expert, total = moe_align(ids, N_EXPERT, bm)
    P = ids.numel()
    used = sorted_pairs[: int(total)]
    real = used[used < P].long()
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    assert (sorted_pairs[int(total) :] == P).all()  # padding after the used rows
    flat = ids.reshape(-1)
    for b in range(int(total) // bm):
        rows = sorted_pairs[b * bm : (b + 1) * bm]
        rows = rows[rows < P].long()
        assert (flat[rows] == block_expert[b]).all()  # a block holds one expert's pairs


def test_moe_dense_rejects_bad_shapes():
    x, w, ids, tw = make_case("q8_0", 2)
    with pytest.raises(ValueError, match="expert tensor for q8_0"):
        moe_dense(x[:, :64].contiguous(), w, "q8_0", ids, tw)
    with pytest.raises(ValueError, match="must both be"):
        moe_dense(x, w, "q8_0", ids[:, :2], tw)
    with pytest.raises(ValueError, match="unknown activation"):
        moe_dense(x, w, "q8_0", ids, tw, activation="relu")


@pytest.mark.parametrize("blocks", [None, (8, 1, 4)])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_moe_q8r_dense_matches_reference(n_tok, blocks):
    """_moe_q8r_kernel, dense: whole q8_0r rows (gate/up as int32 words, down as bytes), down
    sums in registers; one neuron tile per program (None: 64 neurons) or several."""
    from kernels.moe_dense import moe_q8r_decode

    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=20 + n_tok, n_embd=Q8R_N_EMBD)
    y = moe_q8r_decode(x, w, ids, tw, blocks=blocks)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw), 1e-5)


def test_moe_q8r_dense_gelu():
    from kernels.moe_dense import moe_q8r_decode

    x, w, ids, tw = make_case("q8_0r", 2, seed=23, n_embd=Q8R_N_EMBD)
    y = moe_q8r_decode(x, w, ids, tw, activation="gelu")
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, activation="gelu"), 1e-5)
