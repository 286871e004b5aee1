"""The q8_0r decode kernels' launchers: routed experts over repacked Q8_0 rows (n_embd % 64 == 0,
kernels.expert_formats.q8r_supported), gate/up dots on x quantized to Q8 blocks as the C core
quantizes it (4 int8 products per dp4a instruction), whole rows per load (gate/up as int32
words, down as bytes), down sums in registers and one contiguous atomic add per element.

Paths (kernels.expert_paths picks one per batch size):
- "q8r_pipe" (dense): kernels.moe_q8r_pipe's persistent kernel, the next neuron tile's rows
  requested before the current tile's arithmetic;
- "q8r_stream" (dense): kernels.moe_q8r_stream, tiles through shared memory (cp.async);
- "q8r_sparse" (sparse): `_moe_q8r_kernel` below, one program per (pair, neuron tile), the kept
  neurons compacted in registers;
- "q8r_sparse2" (sparse): kernels.moe_q8r_pipe's two-phase persistent kernel (gate tiles, then
  the kept neurons' rows).
The dp4a results are the C core's on the same quantized x: their torch reference is
moe_dense_ref / moe_sparse_ref with q8_x=True. Every launcher takes an optional expert map
(kernels.moe_args).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_formats import ACT_CODES, q8r_supported
from .expert_rows import (
    act_fn,
    blocks_add,
    expert_slot,
    q8r_bytes,
    q8r_dot,
    q8r_dot_q8x,
    q8r_rows_axpy,
    q8r_words,
    quantize_x_lanes,
    token_x_q8,
    x_lanes,
)
from .launch import interpreting, sm_count
from .moe_args import check_moe_args, flat_routing, map_args, zeroed_out_and_count
from .moe_q8r_pipe import (
    _moe_q8r_pipe_kernel,
    _moe_q8r_sparse2_kernel,
    pipe_grid,
    sparse2_list_len,
)
from .moe_q8r_stream import _moe_q8r_stream_kernel, stream_grid
from .sparse_mask import as_threshold

# (BLOCK_N, BA, num_warps) of the sparse _moe_q8r_kernel for one token (P <= 8 pairs) and
# more: bench/sweep_q8r.py on an H100 (three shapes, batch 1, 4 and 16, sparsity 0.85).
Q8R_CONFIGS = {"one": (16, 4, 4), "many": (8, 2, 4)}
# (BLOCK_N, num_warps, programs per SM) of the dense kernels.moe_q8r_pipe kernel: the fastest
# or within 2% of it at batch 1, 4 and 16 on all three shapes (bench/sweep_q8r.py, H100;
# 2 neurons a tile: the pipeline's first load and last arithmetic, which nothing overlaps, are
# short). The interpreter's: fewer, larger steps.
Q8R_PIPE_CONFIG = (2, 8, 2)
Q8R_PIPE_CONFIG_INTERPRETER = (16, 4, 4)
# (BLOCK_N, BK, num_warps, programs per SM) of moe_q8r_sparse2: the fastest of 8 configs at
# batch 1 on all three shapes (H100, bench/sweep_q8r.py --sparse2, sparsity 0.85).
Q8R_SPARSE2_CONFIG = (8, 2, 8, 2)
# kernels.moe_q8r_stream: (BLOCK_N, num_warps, programs per SM, STAGES) (H100,
# bench/sweep_q8r.py --stream, three shapes). The interpreter's: fewer, larger steps (it
# ignores STAGES).
Q8R_STREAM_CONFIG = (2, 4, 4, 4)
Q8R_STREAM_CONFIG_INTERPRETER = (16, 4, 4, 1)
# x is quantized inside every program (no launch before the kernel) up to this many tokens,
# else by one quantize_x_q8 launch first. H100 (bench/sweep_q8r.py --quick, three shapes): in
# the kernel 1.0-1.1x as fast at batch 1 (one launch less), 0.71-0.91x at batch 4 and 16.
Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS = 1


# ----------------------------------------------------------------------------------------------
# x as Q8 blocks


@triton.jit
def _quantize_x_kernel(x_ptr, stride_x, q_ptr, d_ptr, H, NB: tl.constexpr, ASM: tl.constexpr):
    """Token t's x (grid (T,)) as Q8 blocks, as the C core quantizes activations: words
    [T, NB, 8] int32 (lane i in byte i, as q8r_words) and scales [T, NB] f32."""
    t = tl.program_id(0).to(tl.int64)
    x0, x1, x2, x3 = x_lanes(x_ptr + t * stride_x, H, NB)
    xq, xd = quantize_x_lanes(x0, x1, x2, x3, ASM)
    b = tl.arange(0, NB)
    tl.store(q_ptr + (t * NB + b)[:, None] * 8 + tl.arange(0, 8)[None, :], xq)
    tl.store(d_ptr + t * NB + b, xd)


def quantize_x_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H % 32 == 0) -> (words [T, NB, 8] int32, scales [T, NB] f32), NB the power of
    two >= H / 32 (blocks past H / 32 are zero): what the kernels read with DP4A == 1."""
    T, H = x.shape
    nb = triton.next_power_of_2(H // 32)
    q = torch.empty(T, nb, 8, dtype=torch.int32, device=x.device)
    d = torch.empty(T, nb, dtype=torch.float32, device=x.device)
    _quantize_x_kernel[(T,)](x, x.stride(0), q, d, H, NB=nb, ASM=not interpreting())
    return q, d


# ----------------------------------------------------------------------------------------------
# sparse, one program per (pair, neuron tile)


@triton.jit
def _q8r_dot_x(words, d, x0, x1, x2, x3, xq, xd, DP4A: tl.constexpr, ASM: tl.constexpr):
    """[rows] dots of loaded q8_0r rows (q8r_words) with x: integer dots on the Q8 words of x
    (DP4A) or fp32 dots on x's lanes."""
    if DP4A:
        out = q8r_dot_q8x(words, d, xq, xd, ASM)
    else:
        out = q8r_dot(words, d, x0, x1, x2, x3)
    return out


@triton.jit
def _moe_q8r_kernel(
    x_ptr,  # [T, H] f32/bf16, row stride stride_x
    w_ptr,  # q8_0r expert tensor, uint8 [n_slots, F, 3, RB]
    ids_ptr,  # [P] int: expert of each pair
    tw_ptr,  # [P] f32: routing weight of each pair
    y_ptr,  # [T, H] f32, accumulated
    thr_ptr,  # [1] f32 threshold on |act(gate)|
    cnt_ptr,  # [P] int32, zeroed: active neurons of each pair (atomically added)
    xq_ptr,  # DP4A: [T, NB, 8] int32 Q8 words of x (_quantize_x_kernel)
    xd_ptr,  # DP4A: [T, NB] f32 their block scales
    H,
    F,
    RB,  # bytes per row: 34 H / 32
    K,
    stride_x,
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per program
    BA: tl.constexpr,  # kept neurons processed per step (compacted)
    NB: tl.constexpr,  # power of two >= H / 32
    DP4A: tl.constexpr,  # gate/up dots on Q8-quantized x (integer dot per 32-block): 0 off,
    # 1 x quantized beforehand (xq_ptr, xd_ptr), 2 quantized in the kernel
    ASM: tl.constexpr,  # dp4a as the GPU instruction (else its integer twin: interpreter)
    HAS_MAP: tl.constexpr,
):
    """Sparse decode FFN over q8_0r experts (up/down rows of neurons under the threshold
    skipped): one program per (pair, BLOCK_N neurons), whole rows per load (no loop over H),
    the down rows summed in registers ([NB, 32] = H) and added into y with one contiguous
    atomic per element. The gate rows of the BLOCK_N neurons load at once; the kept neurons are
    compacted in registers (their rank among the kept ones, one-hot [BA, BLOCK_N] selection)
    and only they are processed, BA at a time: up/down instructions scale with the kept count,
    not with BLOCK_N, and dropped rows cost neither bytes nor arithmetic."""
    p = tl.program_id(0)
    t = p // K
    e = expert_slot(ids_ptr, map_ptr, p, HAS_MAP)
    if HAS_MAP:
        if e < 0:  # not on this device: nothing added, count left at 0
            return
    if DP4A == 0:  # fp32 dots on x's lanes
        x0, x1, x2, x3 = x_lanes(x_ptr + t.to(tl.int64) * stride_x, H, NB)
        xq, xd = x0, x0
    else:  # integer dots on x's Q8 words (loaded, or quantized by every program: no launch)
        xq, xd = token_x_q8(x_ptr, xq_ptr, xd_ptr, t, stride_x, H, NB, DP4A, ASM)
        x0, x1, x2, x3 = xd, xd, xd, xd  # not read: _q8r_dot_x takes xq, xd
    twp = tl.load(tw_ptr + p).to(tl.float32)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < F
    off = (e * F + n) * 3 * RB  # [BLOCK_N] int64 byte offset of each gate row
    y_row = y_ptr + t.to(tl.int64) * H
    acc = tl.zeros([NB, 32], dtype=tl.float32)
    gw, gd = q8r_words(w_ptr, off, nm, H, NB)
    a = act_fn(_q8r_dot_x(gw, gd, x0, x1, x2, x3, xq, xd, DP4A, ASM), ACT)
    keep = (tl.abs(a) >= tl.load(thr_ptr)) & nm
    ki = keep.to(tl.int32)
    n_keep = tl.sum(ki, axis=0)
    tl.atomic_add(cnt_ptr + p, n_keep, sem="relaxed")
    rank = tl.cumsum(ki, axis=0) - 1  # [BLOCK_N] rank of each kept neuron
    for a0 in range(0, n_keep, BA):
        s = a0 + tl.arange(0, BA)
        sel = keep[None, :] & (rank[None, :] == s[:, None])  # [BA, BLOCK_N] one-hot
        sm = s < n_keep
        j = tl.sum(tl.where(sel, n[None, :], 0), axis=1)  # [BA] kept neuron of each slot
        aj = tl.sum(tl.where(sel, a[None, :], 0.0), axis=1)
        offj = (e * F + j) * 3 * RB
        uw, ud = q8r_words(w_ptr, offj + RB, sm, H, NB)
        dq, dd = q8r_bytes(w_ptr, offj + 2 * RB, sm, H, NB)
        us = _q8r_dot_x(uw, ud, x0, x1, x2, x3, xq, xd, DP4A, ASM)
        acc = q8r_rows_axpy(dq, dd, tl.where(sm, aj * us * twp, 0.0), acc)
    if n_keep > 0:
        blocks_add(y_row, acc, H, NB)


# ----------------------------------------------------------------------------------------------
# launchers


def _check_q8r(x, w, fmt, topk_ids, topk_w, activation, expert_map):
    """check_moe_args, and the q8r kernels' own need: q8_0r experts with n_embd % 64 == 0."""
    H, E, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map)
    if not q8r_supported(fmt, H):
        raise ValueError(f"the q8r kernels need q8_0r experts and n_embd % 64 == 0, got {fmt}, {H}")
    return H, F, rb, T, K


def _programs(per_sm: int, device: torch.device) -> int:
    """Programs of a persistent grid: per_sm per SM (per_sm in all under the interpreter)."""
    return per_sm * (1 if interpreting() else sm_count(device))


def moe_q8r_pipe(x, w, fmt, topk_ids, topk_w, activation="silu", *, expert_map=None, blocks=None,
                 quantize_in_kernel=None) -> torch.Tensor:  # fmt: skip
    """Dense FFN with kernels.moe_q8r_pipe's persistent kernel -> y [T, n_embd] f32: a fixed
    grid of (programs per SM x SMs) programs, each over an equal contiguous run of the
    P * ceil(F / BLOCK_N) neuron tiles. blocks: (BLOCK_N, num_warps, programs per SM), default
    Q8R_PIPE_CONFIG. quantize_in_kernel: x quantized in every program (one token only; default
    up to Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS tokens) instead of by quantize_x_q8 first."""
    H, F, rb, T, K = _check_q8r(x, w, fmt, topk_ids, topk_w, activation, expert_map)
    in_kernel = T <= Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS if quantize_in_kernel is None else (
        quantize_in_kernel)  # fmt: skip
    if in_kernel and T != 1:
        raise ValueError("the dense q8r kernel quantizes x inside at 1 token only")
    bn, nw, per_sm = blocks or (Q8R_PIPE_CONFIG_INTERPRETER if interpreting() else Q8R_PIPE_CONFIG)
    ids, tw = flat_routing(topk_ids, topk_w)
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    xq, xd = (ids, tw) if in_kernel else quantize_x_q8(x)
    n_tiles = ids.numel() * triton.cdiv(F, bn)
    grid, run = pipe_grid(n_tiles, _programs(per_sm, x.device))
    _moe_q8r_pipe_kernel[(grid,)](
        x, w, ids, tw, y, xq, xd, H, F, rb, K, x.stride(0), triton.cdiv(F, bn), n_tiles, run,
        ACT=ACT_CODES[activation], BLOCK_N=bn, NB=triton.next_power_of_2(H // 32),
        DP4A=2 if in_kernel else 1, ASM=not interpreting(), num_warps=nw,
        **map_args(expert_map, ids),
    )  # fmt: skip
    return y


def moe_q8r_stream(x, w, fmt, topk_ids, topk_w, activation="silu", *, expert_map=None,
                   blocks=None) -> torch.Tensor:  # fmt: skip
    """Dense FFN with kernels.moe_q8r_stream (one pair's neuron range per program, tiles
    through the software pipeline; x quantized in every program) -> y [T, n_embd] f32.
    blocks: (BLOCK_N, num_warps, programs per SM, STAGES), default Q8R_STREAM_CONFIG."""
    H, F, rb, T, K = _check_q8r(x, w, fmt, topk_ids, topk_w, activation, expert_map)
    bn, nw, per_sm, stages = blocks or (
        Q8R_STREAM_CONFIG_INTERPRETER if interpreting() else Q8R_STREAM_CONFIG
    )
    P = T * K
    ids, tw = flat_routing(topk_ids, topk_w)
    spp, nps = stream_grid(F, P, bn, _programs(per_sm, x.device))
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    _moe_q8r_stream_kernel[(P * spp,)](
        x, w, ids, tw, y, H, F, rb, K, x.stride(0), spp, nps, ACT=ACT_CODES[activation],
        BLOCK_N=bn, NB=triton.next_power_of_2(H // 32), ASM=not interpreting(), STAGES=stages,
        num_warps=nw, **map_args(expert_map, ids),
    )  # fmt: skip
    return y


def moe_q8r_sparse(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", *, expert_map=None,
                   dp4a=True, blocks=None, quantize_in_kernel=None):  # fmt: skip
    """Sparse FFN in one _moe_q8r_kernel launch (plus one memset, and the x quantization first
    above one token). Returns (y [T, n_embd] f32, active count [P] int32). dp4a: gate/up dots
    on Q8-quantized x (the shipped path; False: fp32 dots on x itself). blocks: (BLOCK_N, BA,
    num_warps), default Q8R_CONFIGS. quantize_in_kernel as moe_q8r_pipe's (any T here)."""
    H, F, rb, T, K = _check_q8r(x, w, fmt, topk_ids, topk_w, activation, expert_map)
    in_kernel = T <= Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS if quantize_in_kernel is None else (
        quantize_in_kernel)  # fmt: skip
    P = T * K
    ids, tw = flat_routing(topk_ids, topk_w)
    y, count = zeroed_out_and_count(T, H, P, x.device)
    bn, ba, nw = blocks or ((64, 4, 4) if interpreting() else Q8R_CONFIGS[
        "one" if P <= 8 else "many"])  # fmt: skip
    xq, xd = quantize_x_q8(x) if dp4a and not in_kernel else (ids, tw)
    _moe_q8r_kernel[(P, triton.cdiv(F, bn))](
        x, w, ids, tw, y, as_threshold(threshold, x.device), count, xq, xd, H, F, rb, K,
        x.stride(0), ACT=ACT_CODES[activation], BLOCK_N=bn, BA=ba,
        NB=triton.next_power_of_2(H // 32), DP4A=(2 if in_kernel else 1) if dp4a else 0,
        ASM=not interpreting(), num_warps=nw, **map_args(expert_map, ids),
    )  # fmt: skip
    return y, count


def moe_q8r_sparse2(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", *,
                    expert_map=None, blocks=None):  # fmt: skip
    """Sparse FFN with kernels.moe_q8r_pipe._moe_q8r_sparse2_kernel (two pipelined phases per
    program). Returns (y [T, n_embd] f32, active count [P] int32). blocks: (BLOCK_N, BK,
    num_warps, programs per SM). x quantized in the kernel at one token, by quantize_x_q8
    first above."""
    H, F, rb, T, K = _check_q8r(x, w, fmt, topk_ids, topk_w, activation, expert_map)
    bn, bk, nw, per_sm = blocks or ((8, 4, 4, 4) if interpreting() else Q8R_SPARSE2_CONFIG)
    P = T * K
    y, count = zeroed_out_and_count(T, H, P, x.device)
    ids, tw = flat_routing(topk_ids, topk_w)
    xq, xd = (ids, tw) if T == 1 else quantize_x_q8(x)
    tpp = triton.cdiv(F, bn)
    grid, run = pipe_grid(P * tpp, _programs(per_sm, x.device))
    n_list = sparse2_list_len(run, bn, tpp, bk)
    lst = torch.empty(grid, n_list, dtype=torch.int32, device=x.device)
    acts = torch.empty(grid, n_list, dtype=torch.float32, device=x.device)
    _moe_q8r_sparse2_kernel[(grid,)](
        x, w, ids, tw, y, as_threshold(threshold, x.device), count, xq, xd, lst, acts, H, F, rb,
        K, x.stride(0), tpp, P * tpp, run, n_list, ACT=ACT_CODES[activation], BLOCK_N=bn,
        BK=bk, NB=triton.next_power_of_2(H // 32), DP4A=2 if T == 1 else 1,
        ASM=not interpreting(), num_warps=nw, **map_args(expert_map, ids),
    )  # fmt: skip
    return y, count
