"""Dense fused MoE over the GGUF expert tensor `ffn_gud_exps` [n_expert, n_ff, 3, n_embd].

    y[t] = sum_k topk_w[t, k] * sum_j act(g_j . x_t) * (u_j . x_t) * d_j     (e = topk_ids[t, k])

The generic kernels (every expert format, dequantizing inside: no dequantized copy of the
weights) and `moe_dense`, which runs the dense path kernels.expert_paths picks:
- "gemv" (small T): `_moe_gemv_kernel`, one program per (token-expert pair, tile of BLOCK_N
  neurons): gate and up dots over n_embd, then the down axpy into y[t] with relaxed fp32 atomics.
  Every weight byte of the routed experts is read once per pair (memory bound). Its other modes
  are kernels.moe_sparse's gate-only and sparse kernels.
- "gemm" (larger T, prefill): pairs are grouped by expert (kernels.moe_align, like vLLM's
  moe_align_block_size; no host sync) and two grouped GEMMs run on tensor-core tiles, one launch
  each: `_moe_gemm_gate_up_kernel` (act(gate) * up -> inter [P, n_ff], in the dot dtype), then
  `_moe_gemm_down_kernel` (inter @ down, times the routing weight, atomically added into y).
  Weight tiles are dequantized in registers from the stored format (expert_rows.rows_tile) to
  the dot dtype: bf16 / f16 tensor cores with fp32 accumulation for bf16 / f16 x, exact fp32
  dots for f32 x (and under the interpreter, whose bf16 dots are wrong).
- "q8r_pipe", "q8r_stream" (q8_0r with n_embd % 64 == 0): kernels.moe_q8r.
- "q4r_pipe" (q4_0r, mxfp4r; biases and swiglu_oai too): kernels.moe_q4r_pipe.

P = T * K token-expert pairs; pair p is token p // K, slot p % K. The output y is fp32. With an
expert map (kernels.moe_args) w holds n_slots experts and pairs whose expert is not on the
device are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_formats import (
    ACT_CODES,
    FMT_CODES,
    act_ref,
    dequantize_rows,
    format_family,
    generic_only,
    quantize_x_q8_ref,
    up_ref,
)
from .expert_paths import BIAS_PATHS, table_path
from .expert_rows import (
    act_fn,
    dot_acc_sum,
    dot_acc_zeros,
    expert_slot,
    gate_up_bias,
    rows_axpy,
    rows_dot,
    rows_dot_acc,
    rows_tile,
    up_fn,
)
from .launch import DOT_BF16, DOT_F16, dot_code, interpreting
from .moe_align import moe_align
from .moe_args import add_down_bias, bias_args, check_moe_args, flat_routing, map_args, n_expert_of
from .moe_q4r_pipe import moe_q4r_pipe
from .moe_q8r import moe_q8r_pipe, moe_q8r_stream

# ----------------------------------------------------------------------------------------------
# "gemv": one program per (pair, neuron tile)


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
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    bias_ptr,  # HAS_BIAS: [n_expert, F, 2] f32 gate / up biases by global expert id
    FMT: tl.constexpr,
    ACT: tl.constexpr,
    MODE: tl.constexpr,  # 0 dense FFN, 1 gate dots only, 2 sparse FFN (masked up/down rows),
    # 3 sparse gate-up: h = act(gate) * up * topk_w of the kept neurons (0 elsewhere) -> out
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ACC2D: tl.constexpr,  # MODE 1/2/3: elementwise accumulation over H chunks (rows_dot_acc)
    HAS_MAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    p = tl.program_id(0)
    tile = tl.program_id(1)
    t = p // K
    e = expert_slot(ids_ptr, map_ptr, p, HAS_MAP)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < F
    if HAS_MAP:
        if e < 0:  # not on this device: nothing added, no count; gate (1) and h (3) rows are 0
            if MODE % 2 == 1:
                tl.store(out_ptr + p.to(tl.int64) * F + n, tl.zeros([BLOCK_N], tl.float32),
                         mask=nm)  # fmt: skip
            return
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
        if HAS_BIAS:
            bg, bu = gate_up_bias(bias_ptr, ids_ptr, p, n, nm, F)
            acc_g += bg
            acc_u += bu
        coef = act_fn(acc_g, ACT) * up_fn(acc_u, ACT) * tl.load(tw_ptr + p).to(tl.float32)
        coef = tl.where(nm, coef, 0.0)
        _rows_axpy_all(w_ptr, gate_off + 2 * RB, nm, coef, y_row, H, rot, FMT, BLOCK_H)
    elif MODE == 1:
        acc_g = _row_dots(w_ptr, gate_off, nm, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
        if HAS_BIAS:
            acc_g += gate_up_bias(bias_ptr, ids_ptr, p, n, nm, F)[0]
        tl.store(out_ptr + p.to(tl.int64) * F + n, acc_g, mask=nm)
    else:
        g = _row_dots(w_ptr, gate_off, nm, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
        if HAS_BIAS:
            bg, bu = gate_up_bias(bias_ptr, ids_ptr, p, n, nm, F)
            g += bg
        a = act_fn(g, ACT)
        keep = (tl.abs(a) >= tl.load(thr_ptr)) & nm
        n_keep = tl.sum(keep.to(tl.int32), axis=0)
        tl.atomic_add(cnt_ptr + p, n_keep, sem="relaxed")
        if MODE == 2:
            if n_keep > 0:  # masked-off rows are never read: only active up/down rows cost bytes
                u = _row_dots(w_ptr, gate_off + RB, keep, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
                if HAS_BIAS:
                    u += bu
                u = up_fn(u, ACT)
                coef = tl.where(keep, a * u * tl.load(tw_ptr + p).to(tl.float32), 0.0)
                _rows_axpy_all(w_ptr, gate_off + 2 * RB, keep, coef, y_row, H, rot, FMT, BLOCK_H)
        else:
            u = _row_dots(w_ptr, gate_off + RB, keep, x_row, H, FMT, BLOCK_N, BLOCK_H, ACC2D)
            if HAS_BIAS:
                u += bu
            u = up_fn(u, ACT)
            coef = tl.where(keep, a * u * tl.load(tw_ptr + p).to(tl.float32), 0.0)
            tl.store(out_ptr + p.to(tl.int64) * F + n, coef, mask=nm)


# (BLOCK_N, BLOCK_H, num_warps, ACC2D) of _moe_gemv_kernel per (MODE, format family):
# "float" and "packed" (q8_0r / q4_0r) picked by bench/sweep_moe.py on an H100 (qwen3-30b-a3b
# shape, batch 1, 4, 16, sparsity 0.85); "block" (GGUF Q8_0 / Q4_0 read unrepacked) from a
# hand sweep at batch 1-4.
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


def gemv_blocks(fmt: str, mode: int, n_pairs: int = 0) -> tuple[int, int, int, bool]:
    """(BLOCK_N, BLOCK_H, num_warps, ACC2D) for _moe_gemv_kernel in `mode`."""
    if interpreting():
        return 64, 256, 4, False
    key = (mode, format_family(fmt))
    if mode == 2 and n_pairs <= 8 and (*key, "one") in GEMV_CONFIGS:
        key = (*key, "one")
    bn, bh, nw, acc2d = GEMV_CONFIGS[key]
    return bn, (min(bh, 256) if fmt == "f32" else bh), nw, acc2d


def moe_dense_gemv(x, w, fmt, topk_ids, topk_w, activation="silu", *, expert_map=None,
                   blocks=None, bias=None) -> torch.Tensor:  # fmt: skip
    """The "gemv" path (any T; best for small T): y [T, n_embd] fp32. blocks: (BLOCK_N,
    BLOCK_H, num_warps, ACC2D), default gemv_blocks(fmt, 0). bias: kernels.moe_args."""
    H, E, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map,
                                       bias, generic=True)  # fmt: skip
    bn, bh, nw, acc2d = blocks or gemv_blocks(fmt, 0)
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    ids, tw = flat_routing(topk_ids, topk_w)
    _moe_gemv_kernel[(T * K, triton.cdiv(F, bn))](
        x, w, ids, tw, y, tw, ids, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACT_CODES[activation], MODE=0,
        BLOCK_N=bn, BLOCK_H=bh, ACC2D=acc2d, num_warps=nw, **map_args(expert_map, ids),
        **bias_args(bias, tw),
    )  # fmt: skip
    return add_down_bias(y, topk_ids, topk_w, bias, expert_map)


# ----------------------------------------------------------------------------------------------
# "gemm": pairs grouped by expert, grouped GEMMs on tl.dot tiles


def inter_dtype(dot: int) -> torch.dtype:
    """dtype of the act * up intermediate between the two GEMMs: the down GEMM's input type."""
    return {DOT_BF16: torch.bfloat16, DOT_F16: torch.float16}.get(dot, torch.float32)


@triton.jit
def _dot(a, b_t, acc, DOT: tl.constexpr):
    """acc + a @ b_t^T: bf16 (DOT 1) or f16 (DOT 2) tensor cores, else exact fp32 (ieee)."""
    if DOT == 1:
        acc = tl.dot(a.to(tl.bfloat16), tl.trans(b_t.to(tl.bfloat16)), acc)
    elif DOT == 2:
        acc = tl.dot(a.to(tl.float16), tl.trans(b_t.to(tl.float16)), acc)
    else:
        acc = tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _moe_gemm_gate_up_kernel(
    x_ptr,  # [T, H] f32/bf16
    w_ptr,  # expert tensor
    sorted_ptr,  # [n_blocks * BLOCK_M] int32 pair ids grouped by expert, P = padding
    blk_expert_ptr,  # [n_blocks] int32 expert id of each block
    total_ptr,  # [1] int32 padded rows in use
    out_ptr,  # [P, F] act(gate) * up (inter_dtype), or gate (GATE_ONLY, f32)
    H,
    F,
    RB,
    K,
    P,
    stride_x,
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    bias_ptr,  # HAS_BIAS: [n_expert, F, 2] f32 gate / up biases by global expert id
    FMT: tl.constexpr,
    ACT: tl.constexpr,
    GATE_ONLY: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = expert_slot(blk_expert_ptr, map_ptr, pid_m, HAS_MAP)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pm = pairs < P
    tok = (pairs // K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < F
    if HAS_MAP:
        if e < 0:  # the block's expert is not on this device: gate rows 0 (GATE_ONLY)
            if GATE_ONLY:
                o = out_ptr + pairs.to(tl.int64)[:, None] * F + n[None, :]
                tl.store(o, tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                         mask=pm[:, None] & nm[None, :])  # fmt: skip
            return
    gate_off = (e * F + n) * 3 * RB

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_K):
        h = h0 + tl.arange(0, BLOCK_K)
        am = pm[:, None] & (h < H)[None, :]
        a = tl.load(x_ptr + tok[:, None] * stride_x + h[None, :], mask=am, other=0.0)
        acc_g = _dot(a, rows_tile(w_ptr, gate_off, nm, h0, H, FMT, BLOCK_K), acc_g, DOT)
        if not GATE_ONLY:
            wu = rows_tile(w_ptr, gate_off + RB, nm, h0, H, FMT, BLOCK_K)
            acc_u = _dot(a, wu, acc_u, DOT)
    if HAS_BIAS:  # the block's experts are one: its biases, by global id
        bg, bu = gate_up_bias(bias_ptr, blk_expert_ptr, pid_m, n, nm, F)
        acc_g += bg[None, :]
        acc_u += bu[None, :]
    if GATE_ONLY:
        out = acc_g
    else:
        out = act_fn(acc_g, ACT) * up_fn(acc_u, ACT)
    o = out_ptr + pairs.to(tl.int64)[:, None] * F + n[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=pm[:, None] & nm[None, :])


@triton.jit
def _moe_gemm_down_kernel(
    inter_ptr,  # [P, F] act(gate) * up (inter_dtype)
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
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    FMT: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per step (the reduction axis here)
    BLOCK_H: tl.constexpr,  # output columns per program
    HAS_MAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = expert_slot(blk_expert_ptr, map_ptr, pid_m, HAS_MAP)
    if HAS_MAP:
        if e < 0:  # the block's expert is not on this device
            return
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
        acc = _dot(a, tl.trans(wd), acc, DOT)
    acc = acc * tl.load(tw_ptr + pairs, mask=pm, other=0.0)[:, None]
    y = y_ptr + (pairs64 // K)[:, None] * H + h[None, :]
    tl.atomic_add(y, acc, mask=pm[:, None] & (h < H)[None, :], sem="relaxed")


# (BLOCK_M, gate-up (BLOCK_N, BLOCK_K, num_warps, num_stages), down (BLOCK_N neurons per step,
# BLOCK_H output columns, num_warps, num_stages)) of the grouped GEMMs by pairs per expert:
# - "few" (<= 8) and "some" (<= 48): H100-measured at T = 16..256 of the qwen3-30b-a3b shape,
#   memory bound in bf16 (~2.9 TB/s at T = 256);
# - "many" (> 48, prefill of hundreds of tokens: olmoe pp512 has 64 per expert): tiles of 64
#   pairs, so each dequantized weight tile (~4 CUDA-core instructions per weight) feeds twice
#   the tensor-core work of a 32-row tile; at 32 rows the dequantization, not the MMA, bounds
#   an SM (an H100 SM does ~1k bf16 MACs per clock against 128 fp32 lanes). 8 warps hold the
#   two 64 x 64 fp32 accumulators of gate and up. Chosen by that count, not timed yet:
#   bench/gpu_prefill.py times it against "some" at pp128 / pp512 / pp2048 shapes.
GEMM_CONFIGS = {
    "few": (16, (64, 128, 4, 3), (32, 128, 4, 3)),
    "some": (32, (64, 128, 4, 3), (32, 128, 4, 3)),
    "many": (64, (64, 64, 8, 3), (64, 128, 8, 3)),
}
GEMM_INTERPRET = (16, (64, 128, 4, 1), (64, 128, 4, 1))  # few programs for the interpreter


def gemm_regime(n_pairs: int, n_expert: int) -> str:
    """GEMM_CONFIGS' key for n_pairs token-expert pairs over n_expert experts."""
    per_expert = n_pairs / n_expert
    return "few" if per_expert <= 8 else "some" if per_expert <= 48 else "many"


def gemm_blocks(n_pairs: int, n_expert: int) -> tuple[int, tuple, tuple]:
    """BLOCK_M and the gate-up and down configs of the grouped GEMMs (GEMM_CONFIGS): a fixed
    rule of the batch shape, the same in every process."""
    if interpreting():
        return GEMM_INTERPRET
    return GEMM_CONFIGS[gemm_regime(n_pairs, n_expert)]


def moe_dense_gemm(x, w, fmt, topk_ids, topk_w, activation="silu", *, expert_map=None,
                   blocks=None, bias=None) -> torch.Tensor:  # fmt: skip
    """The "gemm" path (grouped GEMMs; best for larger T): y [T, n_embd] fp32. blocks:
    (BLOCK_M, gate-up config, down config) as gemm_blocks returns them. bias: kernels.moe_args."""
    H, _, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map,
                                       bias, generic=True)  # fmt: skip
    P, E = T * K, n_expert_of(w, expert_map)
    bm, (bn, bk, nw, ns), (bn2, bk2, nw2, ns2) = blocks or gemm_blocks(P, E)
    sorted_pairs, block_expert, total = moe_align(topk_ids, E, bm)
    n_blocks = block_expert.numel()
    dot = dot_code(x.dtype)
    inter = torch.empty(P, F, device=x.device, dtype=inter_dtype(dot))
    _moe_gemm_gate_up_kernel[(n_blocks, triton.cdiv(F, bn))](
        x, w, sorted_pairs, block_expert, total, inter, H, F, rb, K, P, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACT_CODES[activation], GATE_ONLY=False, DOT=dot,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
        **map_args(expert_map, total), **bias_args(bias, inter),
    )  # fmt: skip
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    tw = topk_w.reshape(-1).float().contiguous()
    _moe_gemm_down_kernel[(n_blocks, triton.cdiv(H, bk2))](
        inter, w, sorted_pairs, block_expert, total, tw, y, H, F, rb, K, P,
        FMT=FMT_CODES[fmt], DOT=dot, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_H=bk2,
        num_warps=nw2, num_stages=ns2, **map_args(expert_map, total),
    )  # fmt: skip
    return add_down_bias(y, topk_ids, topk_w, bias, expert_map)


# ----------------------------------------------------------------------------------------------
# the dense paths

DENSE_LAUNCHERS = {
    "q8r_pipe": moe_q8r_pipe,
    "q4r_pipe": moe_q4r_pipe,
    "q8r_stream": moe_q8r_stream,
    "gemv": moe_dense_gemv,
    "gemm": moe_dense_gemm,
}


def moe_dense(x, w, fmt, topk_ids, topk_w, activation="silu", path="auto", *, expert_map=None,
              bias=None):  # fmt: skip
    """Dense routed-expert FFN: y [T, n_embd] fp32 = sum_k topk_w * expert_{topk_ids}(x).

    x [T, n_embd] f32/bf16; w the expert tensor in `fmt` (kernels.expert_formats);
    topk_ids [T, K] int; topk_w [T, K] float; activation "silu" or "gelu" (tanh approximation);
    path: one of DENSE_LAUNCHERS (kernels.expert_paths; the q8r ones need q8_0r experts with
    n_embd % 64 == 0, q4r_pipe q4_0r / mxfp4r experts; they take the dots on Q8-quantized x,
    as the C core does) or "auto" (the table's choice for T tokens). expert_map, bias:
    kernels.moe_args (bias: "gemv", "gemm" and "q4r_pipe" only).
    """
    if path == "auto":
        path = table_path(fmt, x.shape[1], x.shape[0], sparse=False,
                          generic=generic_only(bias, activation))  # fmt: skip
    if path not in DENSE_LAUNCHERS:
        raise ValueError(f"path must be 'auto' or one of {sorted(DENSE_LAUNCHERS)}, got {path!r}")
    if bias is None:
        return DENSE_LAUNCHERS[path](x, w, fmt, topk_ids, topk_w, activation,
                                     expert_map=expert_map)  # fmt: skip
    if path not in BIAS_PATHS:
        raise ValueError(f"expert biases run on the generic kernels only (gemv, gemm) or "
                         f"q4r_pipe, not {path}")  # fmt: skip
    return DENSE_LAUNCHERS[path](x, w, fmt, topk_ids, topk_w, activation, expert_map=expert_map,
                                 bias=bias)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# torch reference


def dequantize_experts(w: torch.Tensor, fmt: str, n_embd: int) -> torch.Tensor:
    """fp32 [n_expert, n_ff, 3, n_embd] copy of the expert tensor (reference only)."""
    return dequantize_rows(w, fmt, n_embd)


def ref_slot(topk_ids, expert_map, t: int, k: int) -> int:
    """Slot in w of pair (t, k)'s expert (reference side of an expert map; -1: not here)."""
    e = int(topk_ids[t, k])
    return e if expert_map is None else int(expert_map[e])


def moe_dense_ref(x, w, fmt, topk_ids, topk_w, activation="silu", q8_x=False, expert_map=None,
                  bias=None):  # fmt: skip
    """Plain torch: dequantize the experts, y = sum_k w_k * down(act(gate x) * up x), fp32.
    q8_x: the gate/up dots take x quantized to Q8 blocks (quantize_x_q8_ref), as the dp4a
    kernels and the C core do. expert_map: w holds slots (kernels.moe_args). bias: (gate_up
    [n_expert, F, 2], down [n_expert, H]) by global id: act(gate x + bg) * up(up x + bu) and
    + bd (up: kernels.expert_formats.up_ref)."""
    T, H = x.shape
    wf = dequantize_experts(w, fmt, H)
    xf = quantize_x_q8_ref(x).float() if q8_x else x.float()
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for t in range(T):
        for k in range(topk_ids.shape[1]):
            slot = ref_slot(topk_ids, expert_map, t, k)
            if slot < 0:
                continue
            rows = wf[slot]  # [F, 3, H]
            g = rows[:, 0] @ xf[t]
            u = rows[:, 1] @ xf[t]
            e = int(topk_ids[t, k])
            if bias is not None:
                g, u = g + bias[0][e, :, 0], u + bias[0][e, :, 1]
            out = (act_ref(g, activation) * up_ref(u, activation)) @ rows[:, 2]
            if bias is not None:
                out = out + bias[1][e]
            y[t] += float(topk_w[t, k]) * out
    return y
