"""Intra-expert activation-sparse MoE: dense gate, threshold mask, fused sparse up-down.

    y[t] = sum_k topk_w[t, k] * sum_{j : |act(g_j . x_t)| >= thr} act(g_j . x_t) * (u_j . x_t) * d_j

Graph-safe steps (fixed shapes, no host sync; `moe_sparse` runs them):
1. `moe_gate`: gate dots of every neuron of each pair's expert -> gate [P, n_ff] f32
   (the decode GEMV kernel in gate-only mode; grouped GEMM for larger T). Reads 1/3 of the bytes.
2. `kernels.sparse_mask.sparse_mask`: act, |act| >= thr, compacted indices + count per pair.
3. `_moe_sparse_up_down_kernel`: one program per (pair, tile of BLOCK_N active slots); a tile
   starting at or past its count exits at once. It gathers the active neurons' up rows (dot
   with x) and down rows (axpy into y[t], relaxed fp32 atomics). A neuron's up and down rows
   are adjacent in `ffn_gud_exps`, so each active neuron costs two contiguous rows.

For decode, `moe_sparse_fused` does all of it in one kernel (the dense GEMV kernel in MODE 2):
each (pair, neuron tile) program computes its gate dots, masks, and loads only the active
neurons' up/down rows (masked loads cost no memory traffic). At batch 1 on an H100 that beats
the three-launch pipeline, whose fixed per-kernel latency is comparable to its runtime.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_formats import ACTIVATIONS, BLOCKS, FMT_CODES, act_ref
from kernels.expert_rows import dot_acc_sum, dot_acc_zeros, rows_dot_acc
from kernels.moe_dense import (
    DECODE_MAX_TOKENS,
    _moe_gemm_gate_up_kernel,
    _moe_gemv_kernel,
    _prep,
    _rows_axpy_all,
    dequantize_experts,
    gemm_blocks,
    gemv_blocks,
    interpreting,
    moe_align,
)
from kernels.sparse_mask import as_threshold, sparse_mask

# Float-format sparse decode uses the one-kernel path up to this many tokens (H100-measured).
SPARSE_FUSED_MAX_TOKENS = 16


def moe_gate(x, w, fmt, topk_ids, path="auto"):
    """Gate dots g[p, j] = W_gate[e_p, j] . x[p // K] for all neurons: [P, n_ff] f32."""
    dummy_w = torch.zeros(topk_ids.shape, device=x.device)
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, dummy_w, "silu")
    P = T * K
    gate = torch.empty(P, F, device=x.device, dtype=torch.float32)
    if path == "auto":
        path = "decode" if T <= DECODE_MAX_TOKENS else "prefill"
    if path == "decode":
        bn, bh, nw, acc2d = gemv_blocks(fmt, 1)
        ids = topk_ids.reshape(-1).contiguous()
        _moe_gemv_kernel[(P, triton.cdiv(F, bn))](
            x, w, ids, gate, gate, gate, ids, H, F, rb, K, x.stride(0),
            FMT=FMT_CODES[fmt], ACT=0, MODE=1, BLOCK_N=bn, BLOCK_H=bh, ACC2D=acc2d, num_warps=nw,
        )  # fmt: skip
    elif path == "prefill":
        bm, (bn, bk, nw, ns), _ = gemm_blocks(P, E)
        sorted_pairs, block_expert, total = moe_align(topk_ids, E, bm)
        dot_bf16 = x.dtype == torch.bfloat16 and not interpreting()
        _moe_gemm_gate_up_kernel[(block_expert.numel(), triton.cdiv(F, bn))](
            x, w, sorted_pairs, block_expert, total, gate, H, F, rb, K, P, x.stride(0),
            FMT=FMT_CODES[fmt], ACT=0, GATE_ONLY=True, DOT_BF16=dot_bf16,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
        )  # fmt: skip
    else:
        raise ValueError(f"path must be 'auto', 'decode' or 'prefill', got {path!r}")
    return gate


@triton.jit
def _moe_sparse_up_down_kernel(
    x_ptr,  # [T, H] f32/bf16
    w_ptr,  # expert tensor
    ids_ptr,  # [P] expert of each pair
    tw_ptr,  # [P] f32 routing weights
    idx_ptr,  # [P, F] int32 active neuron indices (first cnt[p] valid)
    act_ptr,  # [P, F] f32 act(gate) of those neurons
    cnt_ptr,  # [P] int32 active count
    y_ptr,  # [T, H] f32, accumulated
    H,
    F,
    RB,
    K,
    stride_x,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    p = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
    cnt = tl.load(cnt_ptr + p)
    if start >= cnt:  # empty tile: the grid is sized for a fully dense pair
        return
    s = start + tl.arange(0, BLOCK_N)
    sm = s < cnt
    slot = p.to(tl.int64) * F + s
    j = tl.load(idx_ptr + slot, mask=sm, other=0).to(tl.int64)
    a = tl.load(act_ptr + slot, mask=sm, other=0.0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    t = (p // K).to(tl.int64)
    up_off = ((e * F + j) * 3 + 1) * RB  # down row at +RB
    x_row = x_ptr + t * stride_x

    acc_u = dot_acc_zeros(BLOCK_N, FMT, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        acc_u = rows_dot_acc(acc_u, w_ptr, up_off, sm, x_row, h0, H, FMT, BLOCK_H)
    u = dot_acc_sum(acc_u, FMT)
    coef = tl.where(sm, a * u * tl.load(tw_ptr + p).to(tl.float32), 0.0)
    _rows_axpy_all(w_ptr, up_off + RB, sm, coef, y_ptr + t * H, H, p + start, FMT, BLOCK_H)


def sparse_blocks(fmt: str, n_pairs: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_H, num_warps) of the sparse up-down kernel (H100-measured): 8-slot
    tiles for a single token, so its few non-empty tiles spread over the SMs; 32 above."""
    if interpreting():
        return 64, 256, 4
    return (8 if n_pairs <= 8 else 32), (512 if fmt != "f32" else 256), 4


def moe_sparse_up_down(x, w, fmt, topk_ids, topk_w, idx, act, count, y=None, block_n=None):
    """Fused sparse up-down over the compacted active neurons (sparse_mask's layout); adds
    into y (new zeros if None). Grid (P, cdiv(n_ff, BLOCK_N)): fixed, graph-safe."""
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, topk_w, "silu")
    P = T * K
    if idx.shape != (P, F) or act.shape != (P, F) or count.shape != (P,):
        raise ValueError(f"idx/act must be [P={P}, n_ff={F}] and count [P], got "
                         f"{list(idx.shape)}, {list(act.shape)}, {list(count.shape)}")  # fmt: skip
    bn, bh, nw = sparse_blocks(fmt, P)
    bn = block_n or bn
    if y is None:
        y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_w.reshape(-1).float().contiguous()
    _moe_sparse_up_down_kernel[(P, triton.cdiv(F, bn))](
        x, w, ids, tw, idx, act, count, y, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], BLOCK_N=bn, BLOCK_H=bh, num_warps=nw,
    )  # fmt: skip
    return y


def moe_sparse_fused(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", blocks=None):
    """One-kernel sparse FFN for decode: each (pair, neuron tile) program computes its gate
    dots, masks, then reads only the active neurons' up and down rows (masked loads) and adds
    into y. Returns (y [T, n_embd] f32, active count [P, n_tiles] int32)."""
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, topk_w, activation)
    P = T * K
    bn, bh, nw, acc2d = blocks or gemv_blocks(fmt, 2, P)
    n_tiles = triton.cdiv(F, bn)
    y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    count = torch.empty(P, n_tiles, dtype=torch.int32, device=x.device)
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_w.reshape(-1).float().contiguous()
    _moe_gemv_kernel[(P, n_tiles)](
        x, w, ids, tw, y, as_threshold(threshold, x.device), count, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACTIVATIONS[activation], MODE=2, BLOCK_N=bn, BLOCK_H=bh,
        ACC2D=acc2d, num_warps=nw,
    )  # fmt: skip
    return y, count


def moe_sparse(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", path="auto"):
    """Sparse routed-expert FFN. Returns (y [T, n_embd] f32, active [T, K] int32 neuron counts).

    threshold: float or [1] device tensor on |act(gate)|; 0 keeps every neuron (= moe_dense).
    path: "fused" (one kernel, moe_sparse_fused), "decode" (GEMV gate dots + sparse_mask +
    sparse up-down), "prefill" (grouped-GEMM gate dots + sparse_mask + sparse up-down), or
    "auto": the fastest on an H100 (bench/moe_layer.py): fused for one token and, for float
    formats, up to SPARSE_FUSED_MAX_TOKENS; else decode up to DECODE_MAX_TOKENS; else prefill.
    """
    H, E, F, rb, T, K = _prep(x, w, fmt, topk_ids, topk_w, activation)
    if path == "auto":
        float_fmt = fmt not in BLOCKS
        if T == 1 or (float_fmt and T <= SPARSE_FUSED_MAX_TOKENS):
            path = "fused"
        else:
            path = "decode" if T <= DECODE_MAX_TOKENS else "prefill"
    if path == "fused":
        y, count = moe_sparse_fused(x, w, fmt, topk_ids, topk_w, threshold, activation)
        return y, count.sum(dim=1, dtype=torch.int32).view(T, K)
    gate = moe_gate(x, w, fmt, topk_ids, path=path)
    idx, act, count = sparse_mask(gate, as_threshold(threshold, x.device), activation)
    y = moe_sparse_up_down(x, w, fmt, topk_ids, topk_w, idx, act, count)
    return y, count.view(T, K)


def moe_sparse_ref(x, w, fmt, topk_ids, topk_w, threshold, activation="silu"):
    """Torch reference of moe_sparse: (y [T, n_embd] f32, active [T, K] int32)."""
    T, H = x.shape
    wf = dequantize_experts(w, fmt, H)
    xf = x.float()
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    active = torch.zeros(topk_ids.shape, dtype=torch.int32, device=x.device)
    for t in range(T):
        for k in range(topk_ids.shape[1]):
            rows = wf[int(topk_ids[t, k])]  # [F, 3, H]
            a = act_ref(rows[:, 0] @ xf[t], activation)
            keep = a.abs() >= threshold
            active[t, k] = int(keep.sum())
            h = torch.where(keep, a * (rows[:, 1] @ xf[t]), 0.0)
            y[t] += float(topk_w[t, k]) * (h @ rows[:, 2])
    return y, active


def moe_gate_ref(x, w, fmt, topk_ids):
    """Torch reference of moe_gate: [P, n_ff] f32."""
    wf = dequantize_experts(w, fmt, x.shape[1])
    gates = wf[topk_ids.reshape(-1).long(), :, 0]  # [P, F, H]
    xs = x.float().repeat_interleave(topk_ids.shape[1], dim=0)  # [P, H]
    return torch.einsum("pfh,ph->pf", gates, xs)
