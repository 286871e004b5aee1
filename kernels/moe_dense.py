"""Dense fused MoE over the GGUF expert tensor `ffn_gud_exps` [n_expert, n_ff, 3, n_embd].

    y[t] = sum_k topk_w[t, k] * sum_j act(g_j . x_t) * (u_j . x_t) * d_j     (e = topk_ids[t, k])

Three kernels, all dequantizing inside (no dequantized copy of the weights):
- decode (small T): `_moe_gemv_kernel`, one program per (token-expert pair, tile of BLOCK_N
  neurons): gate and up dots over n_embd, then the down axpy into y[t] with relaxed fp32 atomics.
  Every weight byte of the routed experts is read once per pair (memory bound).
- q8_0r decode (`moe_q8r_decode`; n_embd % 64 == 0): gate/up dots on x quantized to Q8 blocks,
  4 int8 products per dp4a instruction, whole rows per load (gate/up as int32 words, down as
  bytes), down sums in registers and one contiguous atomic add per element. Dense (moe_dense's
  "q8r" path, small batches): kernels.moe_q8r_pipe, a persistent kernel that requests the
  next neuron tile's rows before the current tile's arithmetic, below Q8R_STREAM_MIN_TOKENS
  tokens; kernels.moe_q8r_stream (tiles through shared memory, cp.async) from there on.
  Sparse (kernels.moe_sparse's "q8r" path): at one token the two-phase persistent
  `_moe_q8r_sparse2_kernel` (gate tiles, then the kept neurons' rows), else
  `_moe_q8r_kernel`, one program per (pair, neuron tile), the kept neurons compacted in
  registers.
- prefill (larger T): pairs are grouped by expert (`moe_align`, like vLLM's
  moe_align_block_size, in torch, no host sync) and two grouped GEMMs run on tl.dot tiles:
  `_moe_gemm_gate_up_kernel` (act(gate) * up -> inter [P, n_ff] fp32), then
  `_moe_gemm_down_kernel` (inter @ down, times the routing weight, atomically added into y).

P = T * K token-expert pairs; pair p is token p // K, slot p % K. The output y is fp32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .expert_formats import (
    ACTIVATIONS,
    BLOCKS,
    FMT_CODES,
    REPACKED,
    act_ref,
    check_expert_tensor,
    dequantize_rows,
    quantize_x_q8_ref,
    row_bytes,
)
from .expert_rows import (
    act_fn,
    blocks_add,
    dot_acc_sum,
    dot_acc_zeros,
    q8r_bytes,
    q8r_dot,
    q8r_dot_q8x,
    q8r_rows_axpy,
    q8r_words,
    quantize_x_lanes,
    rows_axpy,
    rows_dot,
    rows_dot_acc,
    rows_tile,
    token_x_q8,
    x_lanes,
)
from .moe_q8r_pipe import (
    _moe_q8r_pipe_kernel,
    _moe_q8r_sparse2_kernel,
    pipe_grid,
    sparse2_list_len,
)
from .moe_q8r_stream import _moe_q8r_stream_kernel, stream_grid
from .sparse_mask import as_threshold


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU interpreter: big blocks, fp32 dots)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# decode: GEMV per (pair, neuron tile)


@triton.jit
def _row_dots(w_ptr, row_off, n_mask, x_row, H, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_H: tl.constexpr, ACC2D: tl.constexpr):  # fmt: skip
    """[BLOCK_N] full-length dots of rows with x (rows off the mask cost no memory traffic)."""
    if ACC2D:
        acc2 = dot_acc_zeros(BLOCK_N, FMT, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            acc2 = rows_dot_acc(acc2, w_ptr, row_off, n_mask, x_row, h0, H, FMT, BLOCK_H)
        acc = dot_acc_sum(acc2, FMT)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            acc += rows_dot(w_ptr, row_off, n_mask, x_row, h0, H, FMT, BLOCK_H)
    return acc


@triton.jit
def _rows_axpy_all(w_ptr, row_off, n_mask, coef, y_row, H, rot, FMT: tl.constexpr,
                   BLOCK_H: tl.constexpr):  # fmt: skip
    """y_row += coef @ rows over all of H; chunks visited from chunk `rot` on, so programs
    that run together hit different y addresses with their atomics."""
    n_chunks = tl.cdiv(H, BLOCK_H)
    for i in range(0, n_chunks):
        h0 = ((i + rot) % n_chunks) * BLOCK_H
        rows_axpy(w_ptr, row_off, n_mask, coef, y_row, h0, H, FMT, BLOCK_H)


@triton.jit
def _moe_gemv_kernel(
    x_ptr,  # [T, H] f32/bf16, row stride stride_x
    w_ptr,  # expert tensor (typed for float formats, uint8 for block formats)
    ids_ptr,  # [P] int: expert of each pair
    tw_ptr,  # [P] f32: routing weight of each pair
    out_ptr,  # MODE 1: gate [P, F] f32; MODE 3: h [P, F] f32; else y [T, H] f32 (accumulated)
    thr_ptr,  # MODE 2/3: [1] f32 threshold on |act(gate)|
    cnt_ptr,  # MODE 2/3: [P] int32, zeroed: active neurons of each pair (atomically added)
    H,
    F,
    RB,  # row stride of the expert tensor: elements (float formats) or bytes (block formats)
    K,
    stride_x,
    FMT: tl.constexpr,
    ACT: tl.constexpr,
    MODE: tl.constexpr,  # 0 dense FFN, 1 gate dots only, 2 sparse FFN (masked up/down rows),
    # 3 sparse gate-up: h = act(gate) * up * topk_w of the kept neurons (0 elsewhere) -> out
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ACC2D: tl.constexpr,  # MODE 1/2/3: elementwise accumulation over H chunks (rows_dot_acc)
):
    p = tl.program_id(0)
    tile = tl.program_id(1)
    t = p // K
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < F
    gate_off = (e * F + n) * 3 * RB  # [BLOCK_N] int64; up row at +RB, down row at +2*RB
    x_row = x_ptr + t.to(tl.int64) * stride_x
    y_row = out_ptr + t.to(tl.int64) * H
    rot = p + tile

    if MODE == 0:
        if ACC2D:  # two passes of elementwise accumulation, one reduction each at the end
            acc_g = _row_dots(w_ptr, gate_off, nm, x_row, H, FMT, BLOCK_N, BLOCK_H, True)
            acc_u = _row_dots(w_ptr, gate_off + RB, nm, x_row, H, FMT, BLOCK_N, BLOCK_H, True)
        else:
            acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):  # gate and up rows are adjacent: one pass
                acc_g += rows_dot(w_ptr, gate_off, nm, x_row, h0, H, FMT, BLOCK_H)
                acc_u += rows_dot(w_ptr, gate_off + RB, nm, x_row, h0, H, FMT, BLOCK_H)
        coef = act_fn(acc_g, ACT) * acc_u * tl.load(tw_ptr + p).to(tl.float32)
        coef = tl.where(nm, coef, 0.0)
        _rows_axpy_all(w_ptr, gate_off + 2 * RB, nm, coef, y_row, H, rot, FMT, BLOCK_H)
    elif MODE == 1:
        acc_g = _row_dots(w_ptr, gate_off, nm, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
        tl.store(out_ptr + p.to(tl.int64) * F + n, acc_g, mask=nm)
    else:
        a = act_fn(_row_dots(w_ptr, gate_off, nm, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D), ACT)
        keep = (tl.abs(a) >= tl.load(thr_ptr)) & nm
        n_keep = tl.sum(keep.to(tl.int32), axis=0)
        tl.atomic_add(cnt_ptr + p, n_keep, sem="relaxed")
        if MODE == 2:
            if n_keep > 0:  # masked-off rows are never read: only active up/down rows cost bytes
                u = _row_dots(w_ptr, gate_off + RB, keep, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
                coef = tl.where(keep, a * u * tl.load(tw_ptr + p).to(tl.float32), 0.0)
                _rows_axpy_all(w_ptr, gate_off + 2 * RB, keep, coef, y_row, H, rot, FMT, BLOCK_H)
        else:
            u = _row_dots(w_ptr, gate_off + RB, keep, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
            coef = tl.where(keep, a * u * tl.load(tw_ptr + p).to(tl.float32), 0.0)
            tl.store(out_ptr + p.to(tl.int64) * F + n, coef, mask=nm)


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
    w_ptr,  # q8_0r expert tensor, uint8 [E, F, 3, RB]
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
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per program
    BA: tl.constexpr,  # kept neurons processed per step (compacted)
    NB: tl.constexpr,  # power of two >= H / 32
    DP4A: tl.constexpr,  # gate/up dots on Q8-quantized x (integer dot per 32-block): 0 off,
    # 1 x quantized beforehand (xq_ptr, xd_ptr), 2 quantized in the kernel
    ASM: tl.constexpr,  # dp4a as the GPU instruction (else its integer twin: interpreter)
):
    """Sparse decode FFN over q8_0r experts (up/down rows of neurons under the threshold
    skipped): one program per (pair, BLOCK_N neurons), whole rows per load (no loop over H),
    the down rows summed in registers ([NB, 32] = H) and added into y with one contiguous
    atomic per element. The gate rows of the BLOCK_N neurons load at once; the kept neurons are
    compacted in registers (their rank among the kept ones, one-hot [BA, BLOCK_N] selection)
    and only they are processed, BA at a time: up/down instructions scale with the kept count,
    not with BLOCK_N, and dropped rows cost neither bytes nor arithmetic. (The dense path is
    kernels.moe_q8r_pipe.)"""
    p = tl.program_id(0)
    t = p // K
    e = tl.load(ids_ptr + p).to(tl.int64)
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


# (BLOCK_N, BLOCK_H, num_warps, ACC2D) of _moe_gemv_kernel per (MODE, format family):
# "float" and "packed" (q8_0r / q4_0r) picked by bench/sweep_moe.py on an H100 (qwen3-30b-a3b
# shape, batch 1, 4, 16, sparsity 0.85; bench/results/moe_layer_h100_sweep.json); "block"
# (GGUF Q8_0 / Q4_0 read unrepacked) from the earlier hand sweep at batch 1-4.
GEMV_CONFIGS = {
    (0, "float"): (16, 1024, 4, False),
    (0, "block"): (8, 512, 2, False),
    (0, "packed"): (8, 512, 8, True),
    (1, "float"): (4, 1024, 4, True),
    (1, "block"): (8, 512, 2, True),
    (1, "packed"): (8, 1024, 4, True),
    (2, "float"): (8, 1024, 4, False),
    (2, "block"): (8, 512, 2, False),
    (2, "packed"): (8, 1024, 4, False),
    # MODE 2 with a single token (P <= 8 pairs): fewer programs, so more neurons per program
    (2, "float", "one"): (16, 1024, 4, False),
    (2, "block", "one"): (8, 512, 2, True),
    (2, "packed", "one"): (8, 1024, 4, False),
    (3, "float"): (16, 1024, 4, False),
    (3, "block"): (8, 512, 2, True),
    (3, "packed"): (8, 1024, 4, False),
}


def format_family(fmt: str) -> str:
    """'float', 'block' (GGUF q8_0/q4_0: byte loads) or 'packed' (q8_0r/q4_0r: wide loads)."""
    if fmt in REPACKED.values():
        return "packed"
    return "block" if fmt in BLOCKS else "float"


def gemv_blocks(fmt: str, mode: int, n_pairs: int = 0) -> tuple[int, int, int, bool]:
    """(BLOCK_N, BLOCK_H, num_warps, ACC2D) for _moe_gemv_kernel in `mode`."""
    if interpreting():
        return 64, 256, 4, False
    key = (mode, format_family(fmt))
    if mode == 2 and n_pairs <= 8 and (*key, "one") in GEMV_CONFIGS:
        key = (*key, "one")
    bn, bh, nw, acc2d = GEMV_CONFIGS[key]
    return bn, (min(bh, 256) if fmt == "f32" else bh), nw, acc2d


def _prep(x, w, fmt, topk_ids, topk_w, activation):
    """Validate the common arguments; return (H, E, F, RB, T, K)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"x must be [T, n_embd] float32 or bfloat16, got {x.dtype} {list(x.shape)}"
        )
    if x.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    T, H = x.shape
    E, F = check_expert_tensor(w, fmt, H)
    if topk_ids.shape != topk_w.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(
            f"topk_ids {list(topk_ids.shape)} and topk_w {list(topk_w.shape)} "
            f"must both be [T={T}, K]"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}"
        )
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_w", topk_w)):
        if tensor.device != w.device:
            raise ValueError(f"{name} is on {tensor.device}, the expert tensor on {w.device}")
    rb = H if FMT_CODES[fmt] == 0 else row_bytes(fmt, H)
    return H, E, F, rb, T, topk_ids.shape[1]


def flat_routing(topk_ids, topk_w):
    """(expert ids [P], routing weights [P] f32), contiguous: the per-pair arrays the kernels
    index with the pair p = token * K + slot."""
    return topk_ids.reshape(-1).contiguous(), topk_w.reshape(-1).float().contiguous()


def moe_dense_decode(x, w, fmt, topk_ids, topk_w, activation="silu", block_n=None, block_h=None,
                     blocks=None):  # fmt: skip
    """Decode path (any T; best for small T): y [T, n_embd] fp32. blocks: (BLOCK_N, BLOCK_H,
    num_warps, ACC2D), default gemv_blocks(fmt, 0); block_n / block_h override those two."""
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, topk_w, activation)
    bn, bh, nw, acc2d = blocks or gemv_blocks(fmt, 0)
    bn, bh = block_n or bn, block_h or bh
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    ids, tw = flat_routing(topk_ids, topk_w)
    grid = (T * K, triton.cdiv(F, bn))
    _moe_gemv_kernel[grid](
        x, w, ids, tw, y, tw, ids, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACTIVATIONS[activation], MODE=0,
        BLOCK_N=bn, BLOCK_H=bh, ACC2D=acc2d, num_warps=nw,
    )  # fmt: skip
    return y


# (BLOCK_N, BA, num_warps) of the sparse _moe_q8r_kernel for one token (P <= 8 pairs) and
# more: bench/sweep_q8r.py on an H100 (three shapes, batch 1, 4 and 16, sparsity 0.85).
Q8R_CONFIGS = {"one": (16, 4, 4), "many": (8, 2, 4)}
# (BLOCK_N, num_warps, programs per SM) of the dense kernels.moe_q8r_pipe kernel: the fastest
# or within 2% of it at batch 1, 4 and 16 on all three shapes (bench/sweep_q8r.py, H100;
# 2 neurons a tile: the pipeline's first load and last arithmetic, which nothing overlaps, are
# short). The interpreter's: fewer, larger steps.
Q8R_PIPE_CONFIG = (2, 8, 2)
Q8R_PIPE_CONFIG_INTERPRETER = (16, 4, 4)


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
    two >= H / 32 (blocks past H / 32 are zero): what the dp4a path of _moe_q8r_kernel reads."""
    T, H = x.shape
    nb = triton.next_power_of_2(H // 32)
    q = torch.empty(T, nb, 8, dtype=torch.int32, device=x.device)
    d = torch.empty(T, nb, dtype=torch.float32, device=x.device)
    _quantize_x_kernel[(T,)](x, x.stride(0), q, d, H, NB=nb, ASM=not interpreting())
    return q, d


# dp4a's x quantization runs inside every program of _moe_q8r_kernel up to this many tokens,
# else in one quantize_x_q8 launch before it. H100 (bench/sweep_q8r.py --quick, three shapes):
# in the kernel 1.0-1.1x as fast at batch 1 (one launch less), 0.71-0.91x at batch 4 and 16.
Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS = 1


def zeroed_out_and_count(T: int, H: int, P: int, device):
    """(y [T, H] f32, count [P] int32), both zero, from one allocation: one memset node in a
    CUDA graph instead of two (each node costs ~2 us at batch 1)."""
    buf = torch.zeros(T * H + P, dtype=torch.float32, device=device)
    return buf[: T * H].view(T, H), buf[T * H :].view(torch.int32)


def q8r_supported(fmt: str, n_embd: int) -> bool:
    """Whether _moe_q8r_kernel takes this layer: q8_0r rows that start 4-byte aligned."""
    return fmt == "q8_0r" and n_embd % 64 == 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prep_q8r(x, w, fmt, topk_ids, topk_w, activation):
    """_prep, and the q8r kernels' own requirement: q8_0r experts with n_embd % 64 == 0."""
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, topk_w, activation)
    if not q8r_supported(fmt, H):
        raise ValueError(f"the q8r path needs q8_0r experts and n_embd % 64 == 0, got {fmt}, {H}")
    return H, E, F, rb, T, K


def moe_q8r_decode(x, w, topk_ids, topk_w, activation="silu", threshold=None, dp4a=True,
                   blocks=None, quantize_in_kernel=None, fmt="q8_0r"):  # fmt: skip
    """Decode FFN over q8_0r experts: dense (threshold None) -> y, with the pipelined
    kernels.moe_q8r_pipe kernel, or sparse -> (y, active count [P] int32) with _moe_q8r_kernel;
    y [T, n_embd] f32 (and count) zeroed in one allocation (but see the defaults below).
    dp4a: gate/up dots on Q8-quantized x (as the C core computes them; the dense kernel has no
    other mode); sparse only: False takes fp32 dots on x itself.
    blocks: dense (BLOCK_N, num_warps, programs per SM), default Q8R_PIPE_CONFIG; sparse
    (BLOCK_N, BA, num_warps), default Q8R_CONFIGS. fmt: the caller's format of w (checked:
    q8_0r, with n_embd % 64 == 0). On a GPU the integer dots are dp4a instructions; the
    interpreter runs their integer twin. quantize_in_kernel: x quantized inside the kernel
    instead of by quantize_x_q8 first (default: up to Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS tokens;
    the dense kernel quantizes once per program, so only at one token).
    dp4a gives the C core's results on the same quantized x (moe_dense_ref(q8_x=True)).
    With the defaults (blocks, quantize_in_kernel None, dp4a) dense at Q8R_STREAM_MIN_TOKENS
    tokens or more takes moe_q8r_stream, sparse at one token moe_q8r_sparse2 (H100 timings at
    those constants).
    """
    H, E, F, rb, T, K = _prep_q8r(x, w, fmt, topk_ids, topk_w, activation)
    P = T * K
    in_kernel = quantize_in_kernel
    if in_kernel is None:
        in_kernel = T <= Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS
    if blocks is None and dp4a and quantize_in_kernel is None:
        if threshold is None and T >= Q8R_STREAM_MIN_TOKENS:
            return moe_q8r_stream(x, w, topk_ids, topk_w, activation, fmt=fmt)
        if threshold is not None and T == 1:
            return moe_q8r_sparse2(x, w, topk_ids, topk_w, threshold, activation, fmt=fmt)
    ids, tw = flat_routing(topk_ids, topk_w)
    if threshold is None:
        if not dp4a or (in_kernel and T != 1):
            raise ValueError("the dense q8r kernel takes dp4a dots, x quantized inside at 1 token")
        y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
        xq, xd = (ids, tw) if in_kernel else quantize_x_q8(x)
        _moe_q8r_dense(x, w, ids, tw, y, xq, xd, H, F, rb, K, activation, in_kernel, blocks)
        return y
    y, count = zeroed_out_and_count(T, H, P, x.device)
    bn, ba, nw = blocks or ((64, 4, 4) if interpreting() else Q8R_CONFIGS[
        "one" if P <= 8 else "many"])  # fmt: skip
    xq, xd = quantize_x_q8(x) if dp4a and not in_kernel else (ids, tw)
    _moe_q8r_kernel[(P, triton.cdiv(F, bn))](
        x, w, ids, tw, y, as_threshold(threshold, x.device), count, xq, xd, H, F, rb, K,
        x.stride(0), ACT=ACTIVATIONS[activation], BLOCK_N=bn, BA=ba,
        NB=triton.next_power_of_2(H // 32), DP4A=(2 if in_kernel else 1) if dp4a else 0,
        ASM=not interpreting(), num_warps=nw,
    )  # fmt: skip
    return y, count


# (BLOCK_N, BK, num_warps, programs per SM) of moe_q8r_sparse2: the fastest of 8 configs at
# batch 1 on all three shapes (H100, bench/sweep_q8r.py --sparse2, sparsity 0.85), where it
# takes 0.90-0.94x the time of the one-wave sparse _moe_q8r_kernel; at batch 4 and 16 it is
# within 1-2% of that kernel, so moe_q8r_decode takes it at one token only.
Q8R_SPARSE2_CONFIG = (8, 2, 8, 2)


def moe_q8r_sparse2(x, w, topk_ids, topk_w, threshold, activation="silu", blocks=None,
                    fmt="q8_0r"):  # fmt: skip
    """Sparse q8_0r decode with kernels.moe_q8r_pipe._moe_q8r_sparse2_kernel (two pipelined
    phases per program). Returns (y [T, n_embd] f32, active count [P] int32).
    blocks: (BLOCK_N, BK, num_warps, programs per SM). x quantized in the kernel at one token,
    by quantize_x_q8 first above."""
    H, E, F, rb, T, K = _prep_q8r(x, w, fmt, topk_ids, topk_w, activation)
    interp = interpreting()
    bn, bk, nw, per_sm = blocks or ((8, 4, 4, 4) if interp else Q8R_SPARSE2_CONFIG)
    P = T * K
    y, count = zeroed_out_and_count(T, H, P, x.device)
    ids, tw = flat_routing(topk_ids, topk_w)
    xq, xd = (ids, tw) if T == 1 else quantize_x_q8(x)
    tpp = triton.cdiv(F, bn)
    grid, run = pipe_grid(P * tpp, per_sm * (1 if interp else _sm_count(x.device)))
    n_list = sparse2_list_len(run, bn, tpp, bk)
    lst = torch.empty(grid, n_list, dtype=torch.int32, device=x.device)
    acts = torch.empty(grid, n_list, dtype=torch.float32, device=x.device)
    _moe_q8r_sparse2_kernel[(grid,)](
        x, w, ids, tw, y, as_threshold(threshold, x.device), count, xq, xd, lst, acts, H, F, rb,
        K, x.stride(0), tpp, P * tpp, run, n_list, ACT=ACTIVATIONS[activation], BLOCK_N=bn,
        BK=bk, NB=triton.next_power_of_2(H // 32), DP4A=2 if T == 1 else 1, ASM=not interp,
        num_warps=nw,
    )  # fmt: skip
    return y, count


# kernels.moe_q8r_stream (dense): (BLOCK_N, num_warps, programs per SM, STAGES), taken by
# moe_q8r_decode from this many tokens on. H100 (bench/sweep_q8r.py --stream, three shapes):
# 1.23-1.33x the pipelined kernel at batch 16, 0.98-1.09x at 4, 0.80-0.84x at 1 (there all
# programs of a token add into the same y row at once, at the end). The interpreter's config:
# fewer, larger steps (it ignores STAGES).
Q8R_STREAM_CONFIG = (2, 4, 4, 4)
Q8R_STREAM_CONFIG_INTERPRETER = (16, 4, 4, 1)
Q8R_STREAM_MIN_TOKENS = 8


def moe_q8r_stream(x, w, topk_ids, topk_w, activation="silu", blocks=None, fmt="q8_0r"):
    """Dense decode FFN over q8_0r experts with kernels.moe_q8r_stream (one pair's neuron range
    per program, tiles through the software pipeline; x quantized in every program as the C
    core quantizes it, dp4a dots) -> y [T, n_embd] f32. blocks: (BLOCK_N, num_warps, programs
    per SM, STAGES), default Q8R_STREAM_CONFIG."""
    H, E, F, rb, T, K = _prep_q8r(x, w, fmt, topk_ids, topk_w, activation)
    interp = interpreting()
    bn, nw, per_sm, stages = blocks or (
        Q8R_STREAM_CONFIG_INTERPRETER if interp else Q8R_STREAM_CONFIG
    )
    P = T * K
    ids, tw = flat_routing(topk_ids, topk_w)
    spp, nps = stream_grid(F, P, bn, per_sm * (1 if interp else _sm_count(x.device)))
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    _moe_q8r_stream_kernel[(P * spp,)](
        x, w, ids, tw, y, H, F, rb, K, x.stride(0), spp, nps, ACT=ACTIVATIONS[activation],
        BLOCK_N=bn, NB=triton.next_power_of_2(H // 32), ASM=not interp, STAGES=stages,
        num_warps=nw,
    )  # fmt: skip
    return y


def _moe_q8r_dense(x, w, ids, tw, y, xq, xd, H, F, rb, K, activation, in_kernel, blocks):
    """Launch the pipelined dense kernel on a fixed grid of (programs per SM x SMs) programs,
    each over an equal contiguous run of the P * ceil(F / BLOCK_N) neuron tiles."""
    interp = interpreting()
    bn, nw, per_sm = blocks or (Q8R_PIPE_CONFIG_INTERPRETER if interp else Q8R_PIPE_CONFIG)
    n_tiles = ids.numel() * triton.cdiv(F, bn)
    grid, run = pipe_grid(n_tiles, per_sm * (1 if interp else _sm_count(x.device)))
    _moe_q8r_pipe_kernel[(grid,)](
        x, w, ids, tw, y, xq, xd, H, F, rb, K, x.stride(0), triton.cdiv(F, bn), n_tiles, run,
        ACT=ACTIVATIONS[activation], BLOCK_N=bn, NB=triton.next_power_of_2(H // 32),
        DP4A=2 if in_kernel else 1, ASM=not interp, num_warps=nw,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# prefill: pairs grouped by expert, grouped GEMMs on tl.dot tiles


def moe_align(topk_ids: torch.Tensor, n_expert: int, block_m: int):
    """Group the P = T*K pairs by expert into BLOCK_M-row blocks (vLLM moe_align_block_size).

    Returns (sorted_pairs [max_padded] int32, with P marking padding; block_expert [n_blocks]
    int32; total [1] int32 = padded rows actually used). Sizes depend only on (P, n_expert,
    block_m), never on the routing, so there is no host sync and the launch is graph-safe:
    blocks at or past `total` exit at once.
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    counts = torch.zeros(n_expert, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)  # [E] end row of each expert's segment
    start = end - padded
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    first = torch.cumsum(counts, 0) - counts  # [E] rank of each expert's first pair in `order`
    e_sorted = flat[order]
    dest = start[e_sorted] + torch.arange(P, device=dev) - first[e_sorted]
    max_padded = P + min(n_expert, P) * (block_m - 1)
    n_blocks = triton.cdiv(max_padded, block_m)
    sorted_pairs = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    rows = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(end, rows, right=True).clamp_(max=n_expert - 1)
    return sorted_pairs, block_expert.to(torch.int32), end[-1:].to(torch.int32)


@triton.jit
def _dot(a, b_t, acc, DOT_BF16: tl.constexpr):
    """acc + a @ b_t^T: bf16 tensor cores when DOT_BF16, else exact fp32 (ieee)."""
    if DOT_BF16:
        acc = tl.dot(a.to(tl.bfloat16), tl.trans(b_t.to(tl.bfloat16)), acc)
    else:
        acc = tl.dot(a, tl.trans(b_t), acc, input_precision="ieee")
    return acc


@triton.jit
def _moe_gemm_gate_up_kernel(
    x_ptr,  # [T, H] f32/bf16
    w_ptr,  # expert tensor
    sorted_ptr,  # [n_blocks * BLOCK_M] int32 pair ids grouped by expert, P = padding
    blk_expert_ptr,  # [n_blocks] int32
    total_ptr,  # [1] int32 padded rows in use
    out_ptr,  # [P, F] f32: act(gate) * up, or gate (GATE_ONLY)
    H,
    F,
    RB,
    K,
    P,
    stride_x,
    FMT: tl.constexpr,
    ACT: tl.constexpr,
    GATE_ONLY: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pm = pairs < P
    tok = (pairs // K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < F
    gate_off = (e * F + n) * 3 * RB

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_K):
        h = h0 + tl.arange(0, BLOCK_K)
        am = pm[:, None] & (h < H)[None, :]
        a = tl.load(x_ptr + tok[:, None] * stride_x + h[None, :], mask=am, other=0.0)
        a = a.to(tl.float32)
        acc_g = _dot(a, rows_tile(w_ptr, gate_off, nm, h0, H, FMT, BLOCK_K), acc_g, DOT_BF16)
        if not GATE_ONLY:
            wu = rows_tile(w_ptr, gate_off + RB, nm, h0, H, FMT, BLOCK_K)
            acc_u = _dot(a, wu, acc_u, DOT_BF16)
    if GATE_ONLY:
        out = acc_g
    else:
        out = act_fn(acc_g, ACT) * acc_u
    o = out_ptr + pairs.to(tl.int64)[:, None] * F + n[None, :]
    tl.store(o, out, mask=pm[:, None] & nm[None, :])


@triton.jit
def _moe_gemm_down_kernel(
    inter_ptr,  # [P, F] f32: act(gate) * up
    w_ptr,
    sorted_ptr,
    blk_expert_ptr,
    total_ptr,
    tw_ptr,  # [P] f32 routing weights
    y_ptr,  # [T, H] f32, accumulated
    H,
    F,
    RB,
    K,
    P,
    FMT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per step (the reduction axis here)
    BLOCK_H: tl.constexpr,  # output columns per program
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pm = pairs < P
    pairs64 = pairs.to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    h = h0 + tl.arange(0, BLOCK_H)

    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for n0 in range(0, F, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < F
        a = tl.load(inter_ptr + pairs64[:, None] * F + n[None, :], mask=pm[:, None] & nm[None, :])
        wd = rows_tile(w_ptr, ((e * F + n) * 3 + 2) * RB, nm, h0, H, FMT, BLOCK_H)  # [BN, BH]
        acc = _dot(a, tl.trans(wd), acc, DOT_BF16)
    acc = acc * tl.load(tw_ptr + pairs, mask=pm, other=0.0)[:, None]
    y = y_ptr + (pairs64 // K)[:, None] * H + h[None, :]
    tl.atomic_add(y, acc, mask=pm[:, None] & (h < H)[None, :], sem="relaxed")


def gemm_blocks(n_pairs: int, n_expert: int) -> tuple[int, tuple, tuple]:
    """BLOCK_M and the (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gate-up and the down
    GEMMs (down: BLOCK_N neurons per step, BLOCK_K output columns), H100-measured at
    T = 16..256 of the qwen3-30b-a3b shape: memory bound in bf16 (~2.9 TB/s at T = 256)."""
    if interpreting():
        return 16, (64, 128, 4, 1), (64, 128, 4, 1)
    block_m = 16 if n_pairs / n_expert <= 8 else 32
    return block_m, (64, 128, 4, 3), (32, 128, 4, 3)


def moe_dense_prefill(x, w, fmt, topk_ids, topk_w, activation="silu", blocks=None):
    """Prefill path (grouped GEMMs): y [T, n_embd] fp32."""
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, topk_w, activation)
    P = T * K
    bm, (bn, bk, nw, ns), (bn2, bk2, nw2, ns2) = blocks or gemm_blocks(P, E)
    sorted_pairs, block_expert, total = moe_align(topk_ids, E, bm)
    n_blocks = block_expert.numel()
    dot_bf16 = x.dtype == torch.bfloat16 and not interpreting()
    inter = torch.empty(P, F, device=x.device, dtype=torch.float32)
    _moe_gemm_gate_up_kernel[(n_blocks, triton.cdiv(F, bn))](
        x, w, sorted_pairs, block_expert, total, inter, H, F, rb, K, P, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACTIVATIONS[activation], GATE_ONLY=False, DOT_BF16=dot_bf16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
    )  # fmt: skip
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    tw = topk_w.reshape(-1).float().contiguous()
    _moe_gemm_down_kernel[(n_blocks, triton.cdiv(H, bk2))](
        inter, w, sorted_pairs, block_expert, total, tw, y, H, F, rb, K, P,
        FMT=FMT_CODES[fmt], DOT_BF16=dot_bf16, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_H=bk2,
        num_warps=nw2, num_stages=ns2,
    )  # fmt: skip
    return y


# Decode below this many tokens (tuned on the H100 with bench/moe_layer.py).
DECODE_MAX_TOKENS = 8
# q8_0r layers (n_embd % 64 == 0) up to this many tokens take _moe_q8r_kernel with dp4a dots:
# on the H100 (bench/sweep_q8r.py --quick, three shapes) 0.94-1.12x the decode GEMV at batch 1,
# 1.28-1.34x at batch 4 and 1.10-2.0x the prefill GEMMs at batch 16.
Q8R_DENSE_MAX_TOKENS = 16


def dense_path(fmt: str, n_tok: int, n_embd: int) -> str:
    """The path moe_dense(path="auto") runs for n_tok tokens of `fmt` (rows of n_embd)."""
    if q8r_supported(fmt, n_embd) and n_tok <= Q8R_DENSE_MAX_TOKENS:
        return "q8r"
    return "decode" if n_tok <= DECODE_MAX_TOKENS else "prefill"


def moe_dense(x, w, fmt, topk_ids, topk_w, activation="silu", path="auto"):
    """Dense routed-expert FFN: y [T, n_embd] fp32 = sum_k topk_w * expert_{topk_ids}(x).

    x [T, n_embd] f32/bf16; w the expert tensor in `fmt` (kernels.expert_formats);
    topk_ids [T, K] int; topk_w [T, K] float; activation "silu" or "gelu" (tanh approximation);
    path "q8r" (q8_0r, n_embd % 64 == 0: moe_q8r_decode with dp4a, x quantized to Q8 blocks
    as the C core does), "decode", "prefill" or "auto" (dense_path).
    """
    if path == "auto":
        path = dense_path(fmt, x.shape[0], x.shape[1])
    if path == "q8r":
        return moe_q8r_decode(x, w, topk_ids, topk_w, activation, dp4a=True, fmt=fmt)
    if path == "decode":
        return moe_dense_decode(x, w, fmt, topk_ids, topk_w, activation)
    if path == "prefill":
        return moe_dense_prefill(x, w, fmt, topk_ids, topk_w, activation)
    raise ValueError(f"path must be 'auto', 'q8r', 'decode' or 'prefill', got {path!r}")


# ----------------------------------------------------------------------------------------------
# torch reference


def dequantize_experts(w: torch.Tensor, fmt: str, n_embd: int) -> torch.Tensor:
    """fp32 [n_expert, n_ff, 3, n_embd] copy of the expert tensor (reference only)."""
    return dequantize_rows(w, fmt, n_embd)


def moe_dense_ref(x, w, fmt, topk_ids, topk_w, activation="silu", q8_x=False):
    """Plain torch: dequantize the experts, y = sum_k w_k * down(act(gate x) * up x), fp32.
    q8_x: the gate/up dots take x quantized to Q8 blocks (quantize_x_q8_ref), as the dp4a
    kernels and the C core do."""
    T, H = x.shape
    wf = dequantize_experts(w, fmt, H)
    xf = quantize_x_q8_ref(x).float() if q8_x else x.float()
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for t in range(T):
        for k in range(topk_ids.shape[1]):
            rows = wf[int(topk_ids[t, k])]  # [F, 3, H]
            g = rows[:, 0] @ xf[t]
            u = rows[:, 1] @ xf[t]
            y[t] += float(topk_w[t, k]) * ((act_ref(g, activation) * u) @ rows[:, 2])
    return y
