"""Persistent, software-pipelined decode MoE over q8_0r experts: the dense "q8r_pipe" path and the
sparse "q8r_sparse2" path (kernels.expert_paths; launched by kernels.moe_q8r).

Gate/up dots on Q8-quantized x (dp4a on a GPU), act, down rows summed in registers, fp32
atomics into y, as the sparse `_moe_q8r_kernel` (kernels.moe_q8r) does. The schedule:

- a fixed grid of about (SMs x occupancy) programs; the P * ceil(F / BLOCK_N) neuron tiles are
  cut into equal contiguous runs, one per program, so a program's tiles mostly belong to one
  (token, expert) pair;
- the loads of tile i + 1 are issued before tile i's arithmetic (registers hold two tiles), so
  an SM's memory requests never stop while it computes: the one-wave kernel loads, then
  computes, then loads again, and HBM idles in between;
- the down sums stay in registers across the tiles of a pair and go to y once per pair change
  (one atomic per element per pair run, not per tile); the routing weight is applied then.

H100 (bench/sweep_q8r.py, three real shapes): 1.18-1.24x the one-wave kernel at batch 1
(2 neurons a tile, 8 warps, 2 programs per SM), 1.03-1.06x at batch 4 and 16. The same schedule
for the sparse mode (tile i + 2's gate rows, tile i + 1's kept up/down rows, tile i's
arithmetic, masked loads instead of the register compaction) took 1.05-1.7x the one-wave
sparse kernel's time: without compaction every tile pays the up/down instructions; with the
compaction inside the persistent loop it was slower still (both dropped; their code is not kept).

With an expert map (kernels.moe_args) a tile of a pair whose expert is not on the device loads
nothing (its neuron mask is off) and its pair adds nothing to y.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .expert_rows import (
    act_fn,
    blocks_add,
    expert_slot,
    q8r_bytes,
    q8r_dot_q8x,
    q8r_rows_axpy,
    q8r_words,
    token_x_q8,
)


@triton.jit
def _tile_rows(ids_ptr, map_ptr, i, end, TPP, F, RB, BLOCK_N: tl.constexpr,
               HAS_MAP: tl.constexpr):  # fmt: skip
    """(pair, byte offset of each gate row [BLOCK_N] int64, neuron mask [BLOCK_N]) of tile i;
    the mask is all off when i >= end (a prefetch past the program's run loads nothing) and,
    with an expert map, when the pair's expert is not on the device."""
    valid = i < end
    p = i // TPP
    e = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int64)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=valid, other=-1).to(tl.int64)
        valid = valid & (e >= 0)
        e = tl.maximum(e, 0)
    n = (i % TPP) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < tl.where(valid, F, 0)
    return p, (e * F + n) * 3 * RB, nm


@triton.jit
def _moe_q8r_pipe_kernel(
    x_ptr,  # [T, H] f32/bf16 (DP4A 2: quantized here; T must be 1)
    w_ptr,  # q8_0r expert tensor, uint8 [E, F, 3, RB]
    ids_ptr,  # [P] int: expert of each pair
    tw_ptr,  # [P] f32: routing weight of each pair
    y_ptr,  # [T, H] f32, zeroed, accumulated
    xq_ptr,  # DP4A 1: [T, NB, 8] int32 Q8 words of x (quantize_x_q8)
    xd_ptr,  # DP4A 1: [T, NB] f32 their scales
    H,
    F,
    RB,  # bytes per row: 34 H / 32
    K,
    stride_x,
    TPP,  # tiles per pair: ceil(F / BLOCK_N)
    n_tiles,  # P * TPP
    run,  # tiles per program
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per tile
    NB: tl.constexpr,  # power of two >= H / 32
    DP4A: tl.constexpr,  # 1: x quantized beforehand, 2: quantized here (T == 1)
    ASM: tl.constexpr,  # dp4a / cvt.rni as GPU instructions (else integer twins)
    HAS_MAP: tl.constexpr,
):
    """Dense: two stages, tile i + 1's three rows requested before tile i's arithmetic."""
    start = tl.program_id(0) * run
    end = tl.minimum(start + run, n_tiles)
    p, off, nm = _tile_rows(ids_ptr, map_ptr, start, end, TPP, F, RB, BLOCK_N, HAS_MAP)
    gw, gd = q8r_words(w_ptr, off, nm, H, NB)
    uw, ud = q8r_words(w_ptr, off + RB, nm, H, NB)
    dq, dd = q8r_bytes(w_ptr, off + 2 * RB, nm, H, NB)
    xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, p // K, stride_x, H, NB, DP4A, ASM)
    acc = tl.zeros([NB, 32], dtype=tl.float32)
    for i in range(start, end):
        # 1. request tile i + 1 (nothing past the run)
        p1, off1, nm1 = _tile_rows(ids_ptr, map_ptr, i + 1, end, TPP, F, RB, BLOCK_N, HAS_MAP)
        gw1, gd1 = q8r_words(w_ptr, off1, nm1, H, NB)
        uw1, ud1 = q8r_words(w_ptr, off1 + RB, nm1, H, NB)
        dq1, dd1 = q8r_bytes(w_ptr, off1 + 2 * RB, nm1, H, NB)
        # 2. tile i's arithmetic (its loads were requested one iteration ago)
        a = act_fn(q8r_dot_q8x(gw, gd, xq, xd, ASM), ACT)
        us = q8r_dot_q8x(uw, ud, xq, xd, ASM)
        acc = q8r_rows_axpy(dq, dd, tl.where(nm, a * us, 0.0), acc)
        # 3. the pair's run ends: its down sums (times the routing weight) go to y
        if (p1 != p) | (i + 1 >= end):
            y_row = y_ptr + (p // K).to(tl.int64) * H
            if HAS_MAP:  # a pair not on the device has nothing to add
                if expert_slot(ids_ptr, map_ptr, p, HAS_MAP) >= 0:
                    blocks_add(y_row, acc * tl.load(tw_ptr + p), H, NB)
            else:
                blocks_add(y_row, acc * tl.load(tw_ptr + p), H, NB)
            acc = tl.zeros([NB, 32], dtype=tl.float32)
            if DP4A == 1:
                if i + 1 < end:  # the next pair's token (past the last tile: none, and p1 // K
                    # may be T, one row past xq)
                    xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, p1 // K, stride_x, H, NB, DP4A,
                                        ASM)  # fmt: skip
        gw, gd, uw, ud, dq, dd, nm, p = gw1, gd1, uw1, ud1, dq1, dd1, nm1, p1


def pipe_grid(n_tiles: int, n_programs: int) -> tuple[int, int]:
    """(programs, tiles per program): equal contiguous runs, at most n_programs of them."""
    run = triton.cdiv(n_tiles, max(1, min(n_tiles, n_programs)))
    return triton.cdiv(n_tiles, run), run


# ----------------------------------------------------------------------------------------------
# sparse, two phases per program (the "q8r_sparse2" path: kernels.moe_q8r.moe_q8r_sparse2)


@triton.jit
def _kept_chunk(lst, acts, c, n_list, ids_ptr, map_ptr, w_ptr, F, RB, H, NB: tl.constexpr,
                BK: tl.constexpr, HAS_MAP: tl.constexpr):  # fmt: skip
    """Chunk c of a program's kept list (BK entries from c, past n_list none): (pair, act [BK],
    valid [BK], up words and scales, down bytes and scales), the rows requested now. Entries
    are pair * F + neuron, -1 for padding; a chunk never holds two pairs (phase 1 pads), and
    only pairs whose expert is on the device have entries."""
    j = c + tl.arange(0, BK)
    g = tl.load(lst + j, mask=j < n_list, other=-1)
    av = tl.load(acts + j, mask=j < n_list, other=0.0)
    valid = g >= 0
    g_max = tl.max(g, axis=0)
    pc = tl.where(g_max >= 0, g_max // F, -1)
    e = expert_slot(ids_ptr, map_ptr, tl.maximum(pc, 0), HAS_MAP)
    if HAS_MAP:
        e = tl.maximum(e, 0)  # chunks of padding only (valid all off): any row will do
    off = (e * F + tl.where(valid, g - pc * F, 0)) * 3 * RB
    uw, ud = q8r_words(w_ptr, off + RB, valid, H, NB)
    dq, dd = q8r_bytes(w_ptr, off + 2 * RB, valid, H, NB)
    return pc, av, valid, uw, ud, dq, dd


@triton.jit
def _moe_q8r_sparse2_kernel(
    x_ptr,  # as _moe_q8r_pipe_kernel
    w_ptr,
    ids_ptr,
    tw_ptr,
    y_ptr,
    thr_ptr,  # [1] f32 threshold on |act(gate)|
    cnt_ptr,  # [P] int32, zeroed: active neurons of each pair
    xq_ptr,
    xd_ptr,
    list_ptr,  # int32 [programs, LIST] scratch: this program's kept neurons (pair * F + n)
    act_ptr,  # f32 [programs, LIST] scratch: their act(gate)
    H,
    F,
    RB,
    K,
    stride_x,
    TPP,
    n_tiles,
    run,
    LIST,
    map_ptr,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per gate tile
    BK: tl.constexpr,  # kept neurons per up/down chunk
    NB: tl.constexpr,
    DP4A: tl.constexpr,
    ASM: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """Sparse decode in two pipelined phases per program, one dependent round trip between
    them (not one per tile): (1) the gate rows of the program's tiles, tile i + 1's requested
    before tile i's dots; kept neurons appended to the program's list; (2) the kept neurons'
    up/down rows, BK at a time, chunk c + 1's requested before chunk c's arithmetic."""
    pid = tl.program_id(0)
    start = pid * run
    end = tl.minimum(start + run, n_tiles)
    thr = tl.load(thr_ptr)
    lst = list_ptr + pid.to(tl.int64) * LIST
    acts = act_ptr + pid.to(tl.int64) * LIST
    # phase 1
    p, off, nm = _tile_rows(ids_ptr, map_ptr, start, end, TPP, F, RB, BLOCK_N, HAS_MAP)
    gw, gd = q8r_words(w_ptr, off, nm, H, NB)
    xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, p // K, stride_x, H, NB, DP4A, ASM)
    n_list = tl.full([], 0, tl.int32)
    kept = tl.full([], 0, tl.int32)
    for i in range(start, end):
        p1, off1, nm1 = _tile_rows(ids_ptr, map_ptr, i + 1, end, TPP, F, RB, BLOCK_N, HAS_MAP)
        gw1, gd1 = q8r_words(w_ptr, off1, nm1, H, NB)
        a = act_fn(q8r_dot_q8x(gw, gd, xq, xd, ASM), ACT)
        keep = (tl.abs(a) >= thr) & nm
        ki = keep.to(tl.int32)
        rank = tl.cumsum(ki, axis=0) - 1
        n = (i % TPP) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(lst + n_list + rank, p * F + n, mask=keep)
        tl.store(acts + n_list + rank, a, mask=keep)
        n_keep = tl.sum(ki, axis=0)
        n_list += n_keep
        kept += n_keep
        if (p1 != p) | (i + 1 >= end):  # the pair's run ends: its count; pad to a chunk
            tl.atomic_add(cnt_ptr + p, kept, sem="relaxed")
            kept = tl.full([], 0, tl.int32)
            padded = (n_list + BK - 1) // BK * BK
            pad = n_list + tl.arange(0, BK)
            tl.store(lst + pad, tl.full([BK], -1, tl.int32), mask=pad < padded)
            n_list = padded
            if DP4A == 1:
                if i + 1 < end:  # p1 // K may be T past the last tile
                    xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, p1 // K, stride_x, H, NB, DP4A,
                                        ASM)  # fmt: skip
        gw, gd, nm, off, p = gw1, gd1, nm1, off1, p1
    tl.debug_barrier()  # the list's stores visible to every thread of the program
    # phase 2
    pc, av, valid, uw, ud, dq, dd = _kept_chunk(lst, acts, 0, n_list, ids_ptr, map_ptr, w_ptr, F,
                                                RB, H, NB, BK, HAS_MAP)  # fmt: skip
    if DP4A == 1:
        xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, tl.maximum(pc, 0) // K, stride_x, H, NB, DP4A,
                       ASM)  # fmt: skip
    acc = tl.zeros([NB, 32], dtype=tl.float32)
    for c in range(0, n_list, BK):
        pc1, av1, valid1, uw1, ud1, dq1, dd1 = _kept_chunk(lst, acts, c + BK, n_list, ids_ptr,
                                                           map_ptr, w_ptr, F, RB, H, NB, BK,
                                                           HAS_MAP)  # fmt: skip
        us = q8r_dot_q8x(uw, ud, xq, xd, ASM)
        acc = q8r_rows_axpy(dq, dd, tl.where(valid, av * us, 0.0), acc)
        if (pc1 != pc) | (c + BK >= n_list):
            blocks_add(y_ptr + (pc // K).to(tl.int64) * H, acc * tl.load(tw_ptr + pc), H, NB)
            acc = tl.zeros([NB, 32], dtype=tl.float32)
            if DP4A == 1:
                xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, tl.maximum(pc1, 0) // K, stride_x, H, NB,
                               DP4A, ASM)  # fmt: skip
        pc, av, valid, uw, ud, dq, dd = pc1, av1, valid1, uw1, ud1, dq1, dd1


def sparse2_list_len(run: int, block_n: int, tiles_per_pair: int, bk: int) -> int:
    """Entries of a program's kept list: every neuron of its run, plus the padding of each pair
    run to a whole chunk (a run of `run` tiles touches at most run // TPP + 2 pairs)."""
    return run * block_n + bk * (run // tiles_per_pair + 2)
