"""Dense decode MoE over q8_0r experts, one (token, expert) pair's neuron range per program, its
tiles streamed through shared memory by Triton's software pipeliner: the "q8r_stream" path
(kernels.expert_paths; launched by kernels.moe_q8r.moe_q8r_stream).

The grid is P * SPP programs: pair p's F neurons are cut into SPP equal ranges of NPS neurons
(a multiple of BLOCK_N). Each program walks its range in BLOCK_N-neuron tiles with
`tl.range(..., num_stages=STAGES)`: on sm_80+ the compiler turns the rows' loads into cp.async
copies into shared memory, STAGES - 1 tiles ahead of the arithmetic, so a program keeps
(STAGES - 1) * BLOCK_N * 3 rows in flight without holding them in registers (the register
pipeline of kernels.moe_q8r_pipe holds one tile ahead and two programs per SM). Every program
quantizes its pair's token itself (DP4A as in kernels.expert_rows.token_x_q8: 64 words, from
L2), so no launch quantizes x first at any batch; its down sums go to y once, at the end.

H100 (bench/sweep_q8r.py --stream): 1.23-1.33x the register-pipelined kernel at batch 16, but
0.80-0.84x at batch 1 (likely because every program of the one token adds its down sums into
the same y row at about the same moment, at the end). A sparse twin (gate tiles streamed,
kept neurons listed in scratch, their up/down rows streamed through the list) was no faster
than the shipped sparse kernels at any batch (0.91-1.05x their speed; dropped, code not kept).

With an expert map (kernels.moe_args) the programs of a pair whose expert is not on the device
exit at once. Under TRITON_INTERPRET=1 num_stages is ignored and the loops run in order.
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
def _pair_range(ids_ptr, map_ptr, SPP, NPS, F, HAS_MAP: tl.constexpr):
    """(pair, its expert's slot as int64 (-1: not on the device), first neuron, end neuron) of
    this program."""
    pid = tl.program_id(0)
    p = pid // SPP
    n0 = (pid % SPP) * NPS
    return p, expert_slot(ids_ptr, map_ptr, p, HAS_MAP), n0, tl.minimum(n0 + NPS, F)


@triton.jit
def _moe_q8r_stream_kernel(
    x_ptr,  # [T, H] f32/bf16
    w_ptr,  # q8_0r expert tensor, uint8 [E, F, 3, RB]
    ids_ptr,  # [P] int: expert of each pair
    tw_ptr,  # [P] f32: routing weight of each pair
    y_ptr,  # [T, H] f32, zeroed, accumulated
    H,
    F,
    RB,  # bytes per row: 34 H / 32
    K,
    stride_x,
    SPP,  # programs per pair
    NPS,  # neurons per program, a multiple of BLOCK_N
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per tile
    NB: tl.constexpr,  # power of two >= H / 32
    ASM: tl.constexpr,  # dp4a / cvt.rni as GPU instructions (else integer twins)
    STAGES: tl.constexpr,  # pipeline depth: tiles in flight + 1
    HAS_MAP: tl.constexpr,
):
    """Dense: y[t] += w_p * sum over the range's neurons of act(g . x) (u . x) d."""
    p, e, n0, n1 = _pair_range(ids_ptr, map_ptr, SPP, NPS, F, HAS_MAP)
    if HAS_MAP:
        if e < 0:
            return
    t = p // K
    xq, xd = token_x_q8(x_ptr, ids_ptr, tw_ptr, t, stride_x, H, NB, 2, ASM)
    acc = tl.zeros([NB, 32], dtype=tl.float32)
    for n in tl.range(n0, n1, BLOCK_N, num_stages=STAGES):
        nn = n + tl.arange(0, BLOCK_N)
        nm = nn < n1
        off = (e * F + nn) * 3 * RB  # [BLOCK_N] byte offsets of the gate rows
        gw, gd = q8r_words(w_ptr, off, nm, H, NB)
        uw, ud = q8r_words(w_ptr, off + RB, nm, H, NB)
        dq, dd = q8r_bytes(w_ptr, off + 2 * RB, nm, H, NB)
        a = act_fn(q8r_dot_q8x(gw, gd, xq, xd, ASM), ACT)
        us = q8r_dot_q8x(uw, ud, xq, xd, ASM)
        acc = q8r_rows_axpy(dq, dd, tl.where(nm, a * us, 0.0), acc)
    blocks_add(y_ptr + t.to(tl.int64) * H, acc * tl.load(tw_ptr + p), H, NB)


def stream_grid(n_ff: int, n_pairs: int, block_n: int, n_programs: int) -> tuple[int, int]:
    """(programs per pair SPP, neurons per program NPS): about n_programs programs in all, each
    pair's n_ff neurons in SPP equal ranges of a whole number of block_n tiles."""
    tiles = triton.cdiv(n_ff, block_n)
    spp = max(1, min(tiles, round(n_programs / n_pairs)))
    nps = triton.cdiv(tiles, spp) * block_n
    return triton.cdiv(n_ff, nps), nps
