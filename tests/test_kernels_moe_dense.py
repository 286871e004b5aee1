"""kernels.moe_dense and kernels.moe_q8r (the dense paths: GEMV, grouped GEMM, the q8_0r decode
kernels) against the torch reference."""

import pytest
import torch

from pyruntime.kernels.expert_paths import quantizes_x, table_path
from pyruntime.kernels.moe_dense import moe_align, moe_dense, moe_dense_ref
from pyruntime.kernels.testing import (
    DEVICE,
    N_EXPERT,
    Q8R_N_EMBD,
    TOP_K,
    assert_close_rel,
    make_bias,
    make_case,
    rtol_for,
)

# the 5-bit and K-quant formats (llama.cpp Q4_K_M / Q5_K_M / Q6_K files)
NEW_FORMATS = ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q8_0r", "q4_0r", "mxfp4", "mxfp4r", *NEW_FORMATS]


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("n_tok", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_dense_matches_reference(fmt, n_tok, path):
    x_dtype = torch.bfloat16 if n_tok == 3 else torch.float32
    x, w, ids, tw = make_case(fmt, n_tok, x_dtype, seed=n_tok)
    y = moe_dense(x, w, fmt, ids, tw, path=path)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw), rtol_for(x_dtype))


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("fmt", ["bf16", "q4_0", "q4_0r"])
def test_moe_dense_gelu(fmt, path):
    x, w, ids, tw = make_case(fmt, 3, seed=5)
    y = moe_dense(x, w, fmt, ids, tw, activation="gelu", path=path)
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw, activation="gelu"), 1e-5)


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("path", ["gemv", "gemm", "auto"])
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q8_0r", "mxfp4", "mxfp4r"])
def test_moe_dense_biased_swiglu_oai(fmt, path, mapped):
    """gpt-oss's experts: gate/up biases inside the kernels, the down bias after them, the
    clamped SwiGLU; biases by global expert id, also through an expert map (w a cache of two
    slots holding experts 4 and 1; the other experts' pairs add nothing, not even a bias)."""
    x, w, ids, tw = make_case(fmt, 3, seed=11)
    bias = make_bias(x.shape[1], seed=11)
    emap = None
    if mapped:
        emap = torch.full((w.shape[0],), -1, dtype=torch.int32, device=w.device)
        emap[4], emap[1] = 0, 1
        w = w[[4, 1]].contiguous()
    y = moe_dense(x, w, fmt, ids, tw, "swiglu_oai", path=path, expert_map=emap, bias=bias)
    taken = table_path(fmt, x.shape[1], 3, sparse=False, generic=True) if path == "auto" else path
    ref = moe_dense_ref(x, w, fmt, ids, tw, "swiglu_oai", q8_x=quantizes_x(taken),
                        expert_map=emap, bias=bias)  # fmt: skip
    assert_close_rel(y, ref, 1e-5)


def test_biases_and_swiglu_oai_need_the_generic_kernels():
    from pyruntime.kernels.moe_q8r import moe_q8r_pipe

    x, w, ids, tw = make_case("q8_0r", 1, n_embd=Q8R_N_EMBD, seed=2)
    with pytest.raises(ValueError, match="generic kernels only"):
        moe_q8r_pipe(x, w, "q8_0r", ids, tw, "swiglu_oai")
    with pytest.raises(ValueError, match="generic kernels only .gemv, gemm. or q4r_pipe, not q8r"):
        moe_dense(x, w, "q8_0r", ids, tw, "silu", path="q8r_pipe", bias=make_bias(Q8R_N_EMBD))
    bad = (make_bias(Q8R_N_EMBD)[0][:, :7], make_bias(Q8R_N_EMBD)[1])
    with pytest.raises(ValueError, match="bias gate_up must be contiguous float32"):
        moe_dense(x, w, "q8_0r", ids, tw, "silu", path="gemv", bias=bad)


@pytest.mark.parametrize("acc2d", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q8_0r", "q4_0r", "mxfp4", "mxfp4r"])
def test_moe_dense_small_blocks_decode(fmt, acc2d):
    """Several neuron tiles and H chunks per program (the GPU block sizes, not the big ones),
    with per-chunk reductions or elementwise accumulation (ACC2D)."""
    from pyruntime.kernels.moe_dense import moe_dense_gemv

    x, w, ids, tw = make_case(fmt, 3, seed=7)
    y = moe_dense_gemv(x, w, fmt, ids, tw, blocks=(16, 32, 4, acc2d))
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw), 1e-5)


@pytest.mark.parametrize("n_expert, n_tok, k, bm", [(6, 17, 3, 4), (6, 300, 3, 16),
                                                    (64, 33, 8, 64), (5, 1, 2, 16)])  # fmt: skip
def test_moe_align_groups_pairs_by_expert(n_expert, n_tok, k, bm):
    """Every pair once, each expert's pairs in one segment padded to bm rows, in expert order
    (the torch reference's segments: same rows, same block table; the order inside a segment
    is the atomics'); experts without pairs (every other one here) take no rows."""
    from pyruntime.kernels.moe_align import moe_align_ref

    g = torch.Generator().manual_seed(n_tok)
    used = torch.arange(0, n_expert, 2)  # odd experts get no pairs
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(n_tok)])
    ids = ids.to(torch.int32).to(DEVICE)
    sorted_pairs, block_expert, total = (t.cpu() for t in moe_align(ids, n_expert, bm))
    ref_pairs, ref_experts, ref_total = moe_align_ref(ids, n_expert, bm)
    assert int(total) == int(ref_total) and sorted_pairs.shape == ref_pairs.shape
    assert torch.equal(block_expert, ref_experts)
    P = ids.numel()
    assert (sorted_pairs[int(total) :] == P).all()  # padding after the used rows
    flat = ids.reshape(-1).cpu()
    n_used_blocks = int(total) // bm
    for e in block_expert[:n_used_blocks].unique().tolist():
        # the same pairs in the expert's segment (in the atomics' order on a GPU: a block of a
        # long segment may hold other pairs than the reference's), its padding at its end
        blocks = (block_expert[:n_used_blocks] == e).nonzero().flatten().tolist()
        seg = torch.cat([sorted_pairs[b * bm : (b + 1) * bm] for b in blocks])
        ref_seg = torch.cat([ref_pairs[b * bm : (b + 1) * bm] for b in blocks])
        n = int((flat == e).sum())
        assert sorted(seg.tolist()) == sorted(ref_seg.tolist())
        assert (seg[:n] < P).all() and (seg[n:] == P).all()
        assert (flat[seg[:n].long()] == e).all()  # a block holds its expert's pairs only


def _routing_without(n_tok: int, skip: tuple[int, ...], seed: int):
    """topk_ids [n_tok, TOP_K] int32 on DEVICE that never pick the experts in `skip`."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(N_EXPERT) if e not in skip])
    rows = [used[torch.randperm(len(used), generator=g)[:TOP_K]] for _ in range(n_tok)]
    return torch.stack(rows).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("regime", ["interpret", "many"])
@pytest.mark.parametrize("n_tok", [1, 7, 33, 300])
@pytest.mark.parametrize("fmt", ["f16", "bf16", "q8_0", "q4_0", "q8_0r", "q4_0r", "mxfp4"])
def test_grouped_gemm_prefill_shapes(fmt, n_tok, regime):
    """The prefill path (grouped GEMMs: gate+up with the activation, then down with the routing
    weight and the scatter-add) at odd token counts, experts 0 and 4 routed no token, bf16 x,
    against dequantize-then-matmul in fp32; with the interpreter's blocks and with the
    "many" regime's (64-pair tiles, as pp512 takes on a GPU). Tolerance: bf16 tensor-core
    tiles on a GPU (rtol_for), fp32 dots here."""
    from pyruntime.kernels.moe_dense import GEMM_CONFIGS, GEMM_INTERPRET, moe_dense_gemm

    x, w, _, tw = make_case(fmt, n_tok, torch.bfloat16, seed=40 + n_tok)
    ids = _routing_without(n_tok, (0, 4), seed=n_tok)
    blocks = GEMM_INTERPRET if regime == "interpret" else GEMM_CONFIGS[regime]
    y = moe_dense_gemm(x, w, fmt, ids, tw, blocks=blocks)
    assert_close_rel(y, moe_dense_ref(x, w, fmt, ids, tw), rtol_for(torch.bfloat16))


def test_gemm_regime_is_a_rule_of_the_shape():
    """The grouped GEMMs' tiles follow pairs per expert only (the same in every process):
    decode-sized batches "few", hundreds of pairs per expert (olmoe pp512: 64) "many"."""
    from pyruntime.kernels.moe_dense import gemm_regime

    assert [gemm_regime(p, 64) for p in (17 * 8, 128 * 8, 512 * 8)] == ["few", "some", "many"]


def test_moe_dense_rejects_bad_shapes():
    x, w, ids, tw = make_case("q8_0", 2)
    with pytest.raises(ValueError, match="expert tensor for q8_0"):
        moe_dense(x[:, :64].contiguous(), w, "q8_0", ids, tw)
    with pytest.raises(ValueError, match="must both be"):
        moe_dense(x, w, "q8_0", ids[:, :2], tw)
    with pytest.raises(ValueError, match="unknown activation"):
        moe_dense(x, w, "q8_0", ids, tw, activation="relu")


# (BLOCK_N, num_warps, programs) of the pipelined dense kernel (the interpreter's grid is
# `programs`): one program over every tile (pair changes mid-run), a few, one tile each
@pytest.mark.parametrize("blocks", [None, (4, 4, 1), (2, 4, 5), (16, 4, 1000)])
@pytest.mark.parametrize("n_tok,in_kernel", [(1, True), (1, False), (3, False)])
def test_moe_q8r_dense_matches_reference(n_tok, in_kernel, blocks):
    """kernels.moe_q8r_pipe (tile i + 1's rows requested before tile i's arithmetic, down sums
    kept across a pair's tiles): integer dots on Q8-quantized x (dp4a on a GPU, its integer
    twin here; x quantized inside the kernel or by quantize_x_q8 first) against the reference
    on the same quantized x."""
    from pyruntime.kernels.moe_q8r import moe_q8r_pipe

    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=20 + n_tok, n_embd=Q8R_N_EMBD)
    if blocks is not None and DEVICE.type == "cuda":  # programs per SM there
        blocks = (*blocks[:2], max(1, blocks[2] // 100))
    y = moe_q8r_pipe(x, w, "q8_0r", ids, tw, blocks=blocks, quantize_in_kernel=in_kernel)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, q8_x=True), 1e-5)


def test_moe_q8r_dense_gelu():
    from pyruntime.kernels.moe_q8r import moe_q8r_pipe

    x, w, ids, tw = make_case("q8_0r", 2, seed=23, n_embd=Q8R_N_EMBD)
    y = moe_q8r_pipe(x, w, "q8_0r", ids, tw, activation="gelu")
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, activation="gelu", q8_x=True), 1e-5)


def test_moe_q8r_dense_takes_in_kernel_x_at_one_token_only():
    from pyruntime.kernels.moe_q8r import moe_q8r_pipe

    x, w, ids, tw = make_case("q8_0r", 2, seed=24, n_embd=Q8R_N_EMBD)
    with pytest.raises(ValueError, match="1 token"):
        moe_q8r_pipe(x, w, "q8_0r", ids, tw, quantize_in_kernel=True)


def test_pipe_grid_covers_every_tile_once():
    from pyruntime.kernels.moe_q8r_pipe import pipe_grid

    for n_tiles in (1, 7, 64, 1000, 1001):
        for n_programs in (1, 3, 132, 5000):
            grid, run = pipe_grid(n_tiles, n_programs)
            assert grid <= n_programs and grid * run >= n_tiles > (grid - 1) * run


def test_quantize_x_q8_ref_is_the_c_core_rounding():
    """Q8 x blocks: d = amax / 127, q = round-half-even(x / d); zero blocks stay zero."""
    from pyruntime.kernels.expert_formats import quantize_x_q8_ref

    x = torch.zeros(64)
    x[:32] = torch.linspace(-1.27, 1.27, 32)
    x[5] = 0.005  # x / d = 0.5: a tie, rounds to even (0)
    x[6] = 0.015  # 1.5 -> 2
    got = quantize_x_q8_ref(x)
    assert got[32:].eq(0).all()
    d = 1.27 / 127
    assert got.dtype == torch.float64  # d * q exactly
    assert torch.allclose(got[:32], (torch.round(x[:32] / d) * d).double(), atol=1e-7)
    assert got[5].item() == 0.0 and got[6].item() == pytest.approx(2 * d, rel=1e-6)


@pytest.mark.parametrize("n_embd", [Q8R_N_EMBD, 256, 2048])
def test_quantize_x_q8_kernel_matches_reference(n_embd):
    """The dp4a path's x quantization (one launch per call): the words hold the reference's
    quants byte by byte (element 4w + i in byte i of word w), the scales its d; blocks past
    n_embd / 32 (NB is a power of two) are zero; x rows at a stride. At n_embd 2048 the
    8 x 2048 values hold near-ties that an FMA-fused rounding flips on a GPU."""
    from pyruntime.kernels.expert_formats import quantize_x_q8_ref
    from pyruntime.kernels.moe_q8r import quantize_x_q8

    gen = torch.Generator().manual_seed(7)
    T = 8
    wide = torch.randn(T, n_embd + 32, generator=gen).to(torch.bfloat16)
    x = wide.to(DEVICE)[:, :n_embd]  # row stride n_embd + 32
    q, d = (t.cpu() for t in quantize_x_q8(x))
    nb = n_embd // 32
    assert q.shape == (T, d.shape[1], 8) and d.shape[1] >= nb and q.dtype == torch.int32
    quants = q.view(torch.int8).reshape(T, -1, 32).double()  # [T, NB, 32]
    # reference on the CPU: IEEE division, as the C core (CUDA torch divides by a scalar
    # through its reciprocal, 1 ulp off at times)
    ref = quantize_x_q8_ref(wide[:, :n_embd]).reshape(T, nb, 32)
    got = quants[:, :nb] * d[:, :nb, None].double()  # d * q exactly, as the reference
    assert torch.equal(got, ref)
    assert quants[:, nb:].eq(0).all() and d[:, nb:].eq(0).all()


def test_dense_table_takes_q8r_for_aligned_q8_0r_up_to_16_tokens():
    """kernels.expert_paths: the pipelined q8r kernel below 8 tokens, the streaming one from 8
    to 16, the grouped GEMMs above; GEMV up to 8 tokens for the other formats."""
    from pyruntime.kernels.expert_paths import table_path

    got = [table_path("q8_0r", 2048, t, sparse=False) for t in (1, 7, 8, 16, 17)]
    assert got == ["q8r_pipe", "q8r_pipe", "q8r_stream", "q8r_stream", "gemm"]
    assert table_path("q8_0r", 96, 1, sparse=False) == "gemv"  # rows not 4-byte aligned
    assert table_path("q8_0", 2048, 1, sparse=False) == "gemv"  # not repacked
    assert [table_path("bf16", 100, t, sparse=False) for t in (8, 9)] == ["gemv", "gemm"]


def test_moe_dense_auto_on_aligned_q8_0r_quantizes_x():
    """moe_dense's auto path on aligned q8_0r is the dp4a kernel: the C core's result on Q8 x
    (and, within the quantization error of x, the float-x one)."""
    x, w, ids, tw = make_case("q8_0r", 2, torch.bfloat16, seed=24, n_embd=Q8R_N_EMBD)
    y = moe_dense(x, w, "q8_0r", ids, tw)
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, q8_x=True), 1e-5)
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw), 2e-2)
    with pytest.raises(ValueError, match="q8_0r"):
        moe_dense(x, w, "q8_0", ids, tw, path="q8r_pipe")
