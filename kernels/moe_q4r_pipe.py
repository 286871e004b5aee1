"""Persistent, software-pipelined decode MoE over 4-bit repacked experts (q4_0r, mxfp4r): the dense
"q4r_pipe" path (kernels.expert_paths), kernels.moe_q8r_pipe's schedule on 4-bit rows.

Gate/up dots on Q8-quantized x by dp4a, the nibbles expanded to int8 lanes in registers
(kernels.q4r_rows), gate and up in one reduction; act (silu, gelu or gpt-oss's swiglu_oai) with
the gate/up biases; down rows through the same lanes, each lane byte to fp32 by one prmt and an
add, summed in registers per row across a pair's tiles (no reduction across warps per tile),
added to y (times the routing weight, plus the expert's down bias) once per pair run, 4 floats
an atomic. The schedule (kernels.moe_q8r_pipe): a fixed grid of about (SMs x programs per SM)
programs over equal contiguous runs of the P * ceil(F / BLOCK_N) neuron tiles, tile i + 1's
rows requested before tile i's arithmetic.

A row is two power-of-two pieces of blocks (row_pieces): gpt-oss's 90 blocks (n_embd 2880) as
64 + 32, not 128 of which 38 are masked (every masked lane costs its instructions too).

The generic "gemv" kernel decodes every nibble to fp32 and spends an FMA on it, which bounds
it by arithmetic at about a sixth of HBM bandwidth; here a gate/up weight costs about a
quarter of a dp4a plus its share of the lane expansion, a down weight a prmt, an add and an
FMA plus its share.

Biases (kernels.moe_args) by global expert id: the gate / up bias per neuron inside the tile's
arithmetic; the down bias added by the program that holds the pair's first tile. With an expert
map a pair whose expert is not on the device loads nothing and adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_formats import ACT_CODES, FMT_CODES, q4r_supported
from .expert_rows import act_fn, expert_slot, gate_up_bias, up_fn
from .launch import interpreting, sm_count
from .moe_args import check_moe_args, flat_routing, map_args
from .moe_q8r import Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS, quantize_x_q8
from .moe_q8r_pipe import _tile_rows, pipe_grid
from .q4r_rows import (
    blocks_at,
    down_elements,
    piece_x_q8,
    q4r_block_dots,
    q4r_down_axpy,
    q4r_words,
    x_words_q4,
)

# (BLOCK_N, num_warps, programs per SM) by format: the fastest of 10 / 8 configs at batch 1 on
# an H100, one layer, CUDA graph, L2 flushed (gpt-oss-20b mxfp4r with biases: 45.0 us, the
# others 50-90; qwen3.5 q4_0r: 14.6 us, the others 14.9-27); 2 warps keep gpt-oss's 32-block
# piece unreplicated (a tensor smaller than the program's threads is held by several warps).
# The interpreter's: fewer, larger steps.
Q4R_PIPE_CONFIGS = {"mxfp4r": (1, 2, 4), "q4_0r": (4, 8, 2)}
Q4R_PIPE_CONFIG_INTERPRETER = (16, 4, 4)


def row_pieces(nb: int) -> tuple[int, int]:
    """(NBA, NBB): a row of nb blocks as two power-of-two pieces, NBA the largest power of two
    <= nb and NBB >= the rest (0 if none): 90 (n_embd 2880) as 64 + 32, not 128."""
    nba = 1 << (nb.bit_length() - 1)
    rest = nb - nba
    return nba, triton.next_power_of_2(rest) if rest else 0


@triton.jit
def _piece_rows(w_ptr, off, nm, RB, H, B0: tl.constexpr, NB: tl.constexpr, FMT: tl.constexpr,
                ALIGN4: tl.constexpr):  # fmt: skip
    """Blocks B0 .. B0 + NB of a tile's gate, up and down rows (kernels.q4r_rows.q4r_words)."""
    gw, gd = q4r_words(w_ptr, off, nm, H, B0, NB, FMT, ALIGN4)
    uw, ud = q4r_words(w_ptr, off + RB, nm, H, B0, NB, FMT, ALIGN4)
    dw, dd = q4r_words(w_ptr, off + 2 * RB, nm, H, B0, NB, FMT, ALIGN4)
    return gw, gd, uw, ud, dw, dd


@triton.jit
def _piece_x(x_ptr, xq_ptr, xd_ptr, t, stride_x, H, B0: tl.constexpr, NB: tl.constexpr,
             NBX: tl.constexpr, FMT: tl.constexpr, DP4A: tl.constexpr,
             ASM: tl.constexpr):  # fmt: skip
    """Token t's Q8 x over blocks B0 .. B0 + NB, as the nibble words' lanes (x_words_q4)."""
    xq, xd = piece_x_q8(x_ptr, xq_ptr, xd_ptr, t, stride_x, H, B0, NB, NBX, DP4A, ASM)
    xa, xb, xs = x_words_q4(xq, FMT)
    return xa, xb, xs, xd


@triton.jit
def _piece_gu(gw, gd, uw, ud, xa, xb, xs, xd, FMT: tl.constexpr, ASM: tl.constexpr):
    """A piece's gate and up dots [BLOCK_N], both in one reduction."""
    gb = q4r_block_dots(gw, gd, xa, xb, xs, xd, FMT, ASM)
    ub = q4r_block_dots(uw, ud, xa, xb, xs, xd, FMT, ASM)
    return tl.split(tl.sum(tl.join(gb, ub), axis=1))


@triton.jit
def _acc_zeros(BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """A piece's zeroed down sums (kernels.q4r_rows.q4r_down_axpy)."""
    return tl.zeros([BLOCK_N, NB, 4, 2, 2, 2], dtype=tl.float32)


@triton.jit
def _piece_flush(y_row, bias_row, twp, first, acc, H, B0: tl.constexpr, NB: tl.constexpr,
                 FMT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """A piece's down sums (plus the down bias where `first`) times twp into y_row."""
    a = down_elements(acc, FMT)
    h, m = blocks_at(B0, NB, H)
    if HAS_BIAS:
        if first:
            a += tl.load(bias_row + h, mask=m, other=0.0)
    tl.atomic_add(y_row + h, a * twp, mask=m, sem="relaxed")


@triton.jit
def _pair_flush(y_ptr, ids_ptr, tw_ptr, map_ptr, dbias_ptr, p, K, H, acc_a, acc_b, first,
                NBA: tl.constexpr, NBB: tl.constexpr, FMT: tl.constexpr, HAS_MAP: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """Pair p's down sums (plus its expert's down bias where `first`: this program holds the
    pair's first tile) times its routing weight into y's row of its token; nothing for a pair
    whose expert is not on the device."""
    on = expert_slot(ids_ptr, map_ptr, p, HAS_MAP) >= 0
    if on:
        twp = tl.load(tw_ptr + p)
        y_row = y_ptr + (p // K).to(tl.int64) * H
        bias_row = dbias_ptr
        if HAS_BIAS:
            bias_row = dbias_ptr + tl.load(ids_ptr + p).to(tl.int64) * H
        _piece_flush(y_row, bias_row, twp, first, acc_a, H, 0, NBA, FMT, HAS_BIAS)
        if NBB > 0:
            _piece_flush(y_row, bias_row, twp, first, acc_b, H, NBA, NBB, FMT, HAS_BIAS)


@triton.jit
def _moe_q4r_pipe_kernel(
    x_ptr,  # [T, H] f32/bf16 (DP4A 2: quantized here; T must be 1)
    w_ptr,  # q4_0r / mxfp4r expert tensor, uint8 [E, F, 3, RB]
    ids_ptr,  # [P] int: expert of each pair
    tw_ptr,  # [P] f32: routing weight of each pair
    y_ptr,  # [T, H] f32, zeroed, accumulated
    xq_ptr,  # DP4A 1: [T, NBX, 8] int32 Q8 words of x (quantize_x_q8)
    xd_ptr,  # DP4A 1: [T, NBX] f32 their scales
    H,
    F,
    RB,  # bytes per row (kernels.expert_formats.row_bytes)
    K,
    stride_x,
    TPP,  # tiles per pair: ceil(F / BLOCK_N)
    n_tiles,  # P * TPP
    run,  # tiles per program
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    bias_ptr,  # HAS_BIAS: [n_expert, F, 2] f32 gate / up biases by global expert id
    dbias_ptr,  # HAS_BIAS: [n_expert, H] f32 down biases by global expert id
    FMT: tl.constexpr,  # 4 q4_0r, 8 mxfp4r (kernels.expert_formats.FMT_CODES)
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per tile
    NBA: tl.constexpr,  # the row's blocks as two pieces: 0 .. NBA, NBA .. NBA + NBB (NBB 0: one)
    NBB: tl.constexpr,
    NBX: tl.constexpr,  # power of two >= H / 32: xq's blocks a row
    DP4A: tl.constexpr,  # 1: x quantized beforehand, 2: quantized here (T == 1)
    ASM: tl.constexpr,  # dp4a / prmt / cvt.rni as GPU instructions (else integer twins)
    ALIGN4: tl.constexpr,  # rows start 4-byte aligned (kernels.q4r_rows.q4r_words)
    HAS_MAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    start = tl.program_id(0) * run
    end = tl.minimum(start + run, n_tiles)
    p, off, nm = _tile_rows(ids_ptr, map_ptr, start, end, TPP, F, RB, BLOCK_N, HAS_MAP)
    gw, gd, uw, ud, dw, dd = _piece_rows(w_ptr, off, nm, RB, H, 0, NBA, FMT, ALIGN4)
    xa, xb, xs, xd = _piece_x(x_ptr, xq_ptr, xd_ptr, p // K, stride_x, H, 0, NBA, NBX, FMT, DP4A,
                              ASM)  # fmt: skip
    acc_a = _acc_zeros(BLOCK_N, NBA)
    acc_b = acc_a  # NBB 0: unused
    if NBB > 0:
        gw2, gd2, uw2, ud2, dw2, dd2 = _piece_rows(w_ptr, off, nm, RB, H, NBA, NBB, FMT, ALIGN4)
        xa2, xb2, xs2, xd2 = _piece_x(x_ptr, xq_ptr, xd_ptr, p // K, stride_x, H, NBA, NBB, NBX,
                                      FMT, DP4A, ASM)  # fmt: skip
        acc_b = _acc_zeros(BLOCK_N, NBB)
    for i in range(start, end):
        # 1. request tile i + 1 (nothing past the run)
        p1, off1, nm1 = _tile_rows(ids_ptr, map_ptr, i + 1, end, TPP, F, RB, BLOCK_N, HAS_MAP)
        gw1, gd1, uw1, ud1, dw1, dd1 = _piece_rows(w_ptr, off1, nm1, RB, H, 0, NBA, FMT, ALIGN4)
        if NBB > 0:
            gw21, gd21, uw21, ud21, dw21, dd21 = _piece_rows(w_ptr, off1, nm1, RB, H, NBA, NBB,
                                                             FMT, ALIGN4)  # fmt: skip
        # 2. tile i's arithmetic (its loads were requested one iteration ago)
        g, u = _piece_gu(gw, gd, uw, ud, xa, xb, xs, xd, FMT, ASM)
        if NBB > 0:
            g2, u2 = _piece_gu(gw2, gd2, uw2, ud2, xa2, xb2, xs2, xd2, FMT, ASM)
            g += g2
            u += u2
        if HAS_BIAS:
            n = (i % TPP) * BLOCK_N + tl.arange(0, BLOCK_N)
            bg, bu = gate_up_bias(bias_ptr, ids_ptr, p, n, nm, F)
            g += bg
            u += bu
        coef = tl.where(nm, act_fn(g, ACT) * up_fn(u, ACT), 0.0)
        acc_a = q4r_down_axpy(dw, dd, coef, acc_a, FMT, ASM)
        if NBB > 0:
            acc_b = q4r_down_axpy(dw2, dd2, coef, acc_b, FMT, ASM)
        # 3. the pair's run ends: its down sums go to y
        if (p1 != p) | (i + 1 >= end):
            _pair_flush(y_ptr, ids_ptr, tw_ptr, map_ptr, dbias_ptr, p, K, H, acc_a, acc_b,
                        p * TPP >= start, NBA, NBB, FMT, HAS_MAP, HAS_BIAS)  # fmt: skip
            acc_a = _acc_zeros(BLOCK_N, NBA)
            if NBB > 0:
                acc_b = _acc_zeros(BLOCK_N, NBB)
            if DP4A == 1:
                if i + 1 < end:  # the next pair's token (p1 // K may be T past the last tile)
                    xa, xb, xs, xd = _piece_x(x_ptr, xq_ptr, xd_ptr, p1 // K, stride_x, H, 0, NBA,
                                              NBX, FMT, DP4A, ASM)  # fmt: skip
                    if NBB > 0:
                        xa2, xb2, xs2, xd2 = _piece_x(x_ptr, xq_ptr, xd_ptr, p1 // K, stride_x, H,
                                                      NBA, NBB, NBX, FMT, DP4A, ASM)  # fmt: skip
        gw, gd, uw, ud, dw, dd, nm, p = gw1, gd1, uw1, ud1, dw1, dd1, nm1, p1
        if NBB > 0:
            gw2, gd2, uw2, ud2, dw2, dd2 = gw21, gd21, uw21, ud21, dw21, dd21


def moe_q4r_pipe(x, w, fmt, topk_ids, topk_w, activation="silu", *, expert_map=None, bias=None,
                 blocks=None, quantize_in_kernel=None) -> torch.Tensor:  # fmt: skip
    """Dense FFN over q4_0r / mxfp4r experts with _moe_q4r_pipe_kernel -> y [T, n_embd] f32.

    Gate/up dots on x quantized to Q8 blocks (its torch reference: moe_dense_ref with
    q8_x=True). bias, expert_map: kernels.moe_args (biases and swiglu_oai taken inside).
    blocks: (BLOCK_N, num_warps, programs per SM), default Q4R_PIPE_CONFIGS[fmt].
    quantize_in_kernel: as kernels.moe_q8r.moe_q8r_pipe's (one token only)."""
    H, _, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map, bias,
                                       generic=True)  # fmt: skip
    if not q4r_supported(fmt, H):
        raise ValueError(f"the q4r kernel needs q4_0r or mxfp4r experts, got {fmt}")
    in_kernel = T <= Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS if quantize_in_kernel is None else (
        quantize_in_kernel)  # fmt: skip
    if in_kernel and T != 1:
        raise ValueError("the dense q4r kernel quantizes x inside at 1 token only")
    bn, nw, per_sm = blocks or (
        Q4R_PIPE_CONFIG_INTERPRETER if interpreting() else Q4R_PIPE_CONFIGS[fmt]
    )
    nba, nbb = row_pieces(H // 32)
    ids, tw = flat_routing(topk_ids, topk_w)
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    xq, xd = (ids, tw) if in_kernel else quantize_x_q8(x)
    tpp = triton.cdiv(F, bn)
    n_tiles = ids.numel() * tpp
    programs = per_sm * (1 if interpreting() else sm_count(x.device))
    grid, run = pipe_grid(n_tiles, programs)
    _moe_q4r_pipe_kernel[(grid,)](
        x, w, ids, tw, y, xq, xd, H, F, rb, K, x.stride(0), tpp, n_tiles, run,
        bias_ptr=tw if bias is None else bias[0], dbias_ptr=tw if bias is None else bias[1],
        FMT=FMT_CODES[fmt], ACT=ACT_CODES[activation], BLOCK_N=bn, NBA=nba, NBB=nbb,
        NBX=triton.next_power_of_2(H // 32), DP4A=2 if in_kernel else 1,
        ASM=not interpreting(),
        ALIGN4=rb % 4 == 0, HAS_BIAS=bias is not None, num_warps=nw,
        **map_args(expert_map, ids),
    )  # fmt: skip
    return y
