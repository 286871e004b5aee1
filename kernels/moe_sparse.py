"""Intra-expert activation-sparse MoE: dense gate, threshold mask, sparse up-down.

    y[t] = sum_k topk_w[t, k] * sum_{j : |act(g_j . x_t)| >= thr} act(g_j . x_t) * (u_j . x_t) * d_j

`moe_sparse` runs the sparse path kernels.expert_paths picks (all graph-safe: fixed shapes, no
host sync, the threshold a device tensor):
- "gemv_mask" / "gemm_mask": three steps. (1) `moe_gate`: gate dots of every neuron of each
  pair's expert -> gate [P, n_ff] f32 (the GEMV kernel in gate-only mode, or the grouped GEMM),
  1/3 of the bytes; (2) kernels.sparse_mask: act, |act| >= thr, compacted indices + count per
  pair; (3) `_moe_sparse_up_down_kernel`: one program per (pair, tile of BLOCK_N active slots),
  a tile at or past its count exits at once; it gathers the active neurons' up rows (dot with
  x) and down rows (axpy into y[t], relaxed fp32 atomics). A neuron's up and down rows are
  adjacent in `ffn_gud_exps`, so each active neuron costs two contiguous rows.
- "fused" (`moe_sparse_fused`): all of it in one kernel (the GEMV kernel in MODE 2): each
  (pair, neuron tile) program computes its gate dots, masks, and loads only the active neurons'
  up/down rows (masked loads cost no memory traffic). At batch 1 on an H100 that beats the
  three-launch pipeline, whose fixed per-kernel latency is comparable to its runtime.
- "split" (`moe_sparse_split`): gate + mask + up in one kernel writing h [P, n_ff], then a down
  kernel with one atomic per output element per neuron slice (an alternative for comparisons).
- "q8r_sparse", "q8r_sparse2" (q8_0r, n_embd % 64 == 0): kernels.moe_q8r.
With an expert map (kernels.moe_args) pairs whose expert is not on the device are skipped:
they add nothing to y and their active count is 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .expert_formats import (
    ACT_CODES,
    FMT_CODES,
    act_ref,
    format_family,
    generic_only,
    quantize_x_q8_ref,
    up_ref,
)
from .expert_paths import table_path
from .expert_rows import dot_acc_sum, dot_acc_zeros, expert_slot, rows_dot_acc, rows_tile
from .launch import dot_code, interpreting
from .moe_args import (
    add_down_bias,
    bias_args,
    check_moe_args,
    flat_routing,
    map_args,
    n_expert_of,
    zeroed_out_and_count,
)
from .moe_dense import (
    _moe_gemm_gate_up_kernel,
    _moe_gemv_kernel,
    _rows_axpy_all,
    dequantize_experts,
    gemm_blocks,
    gemv_blocks,
    moe_align,
    ref_slot,
)
from .moe_q8r import moe_q8r_sparse, moe_q8r_sparse2
from .sparse_mask import as_threshold, sparse_mask


def moe_gate(x, w, fmt, topk_ids, path="auto", *, expert_map=None):
    """Gate dots g[p, j] = W_gate[e_p, j] . x[p // K] for all neurons: [P, n_ff] f32 (rows of
    pairs whose expert is not on the device: 0). path "gemv", "gemm" or "auto" (the one the
    dense table takes at T tokens)."""
    dummy_w = torch.zeros(topk_ids.shape, device=x.device)
    H, _, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, dummy_w, "silu", expert_map)
    P = T * K
    gate = torch.empty(P, F, device=x.device, dtype=torch.float32)
    if path == "auto":
        path = "gemm" if table_path(fmt, H, T, sparse=False) == "gemm" else "gemv"
    if path == "gemv":
        bn, bh, nw, acc2d = gemv_blocks(fmt, 1)
        ids = topk_ids.reshape(-1).contiguous()
        _moe_gemv_kernel[(P, triton.cdiv(F, bn))](
            x, w, ids, gate, gate, gate, ids, H, F, rb, K, x.stride(0), FMT=FMT_CODES[fmt],
            ACT=0, MODE=1, BLOCK_N=bn, BLOCK_H=bh, ACC2D=acc2d, num_warps=nw,
            **map_args(expert_map, ids), **bias_args(None, gate),
        )  # fmt: skip
    elif path == "gemm":
        E = n_expert_of(w, expert_map)
        bm, (bn, bk, nw, ns), _ = gemm_blocks(P, E)
        sorted_pairs, block_expert, total = moe_align(topk_ids, E, bm)
        _moe_gemm_gate_up_kernel[(block_expert.numel(), triton.cdiv(F, bn))](
            x, w, sorted_pairs, block_expert, total, gate, H, F, rb, K, P, x.stride(0),
            FMT=FMT_CODES[fmt], ACT=0, GATE_ONLY=True, DOT=dot_code(x.dtype),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
            **map_args(expert_map, total), **bias_args(None, gate),
        )  # fmt: skip
    else:
        raise ValueError(f"path must be 'auto', 'gemv' or 'gemm', got {path!r}")
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
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    p = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
    cnt = tl.load(cnt_ptr + p)
    if start >= cnt:  # empty tile: the grid is sized for a fully dense pair
        return
    e = expert_slot(ids_ptr, map_ptr, p, HAS_MAP)
    if HAS_MAP:
        if e < 0:  # not on this device
            return
    s = start + tl.arange(0, BLOCK_N)
    sm = s < cnt
    slot = p.to(tl.int64) * F + s
    j = tl.load(idx_ptr + slot, mask=sm, other=0).to(tl.int64)
    a = tl.load(act_ptr + slot, mask=sm, other=0.0)
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


def moe_sparse_up_down(x, w, fmt, topk_ids, topk_w, idx, act, count, y=None, block_n=None, *,
                       expert_map=None):  # fmt: skip
    """Fused sparse up-down over the compacted active neurons (sparse_mask's layout); adds
    into y (new zeros if None). Grid (P, cdiv(n_ff, BLOCK_N)): fixed, graph-safe."""
    H, _, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, "silu", expert_map)
    P = T * K
    if idx.shape != (P, F) or act.shape != (P, F) or count.shape != (P,):
        raise ValueError(f"idx/act must be [P={P}, n_ff={F}] and count [P], got "
                         f"{list(idx.shape)}, {list(act.shape)}, {list(count.shape)}")  # fmt: skip
    bn, bh, nw = sparse_blocks(fmt, P)
    bn = block_n or bn
    if y is None:
        y = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    ids, tw = flat_routing(topk_ids, topk_w)
    _moe_sparse_up_down_kernel[(P, triton.cdiv(F, bn))](
        x, w, ids, tw, idx, act, count, y, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], BLOCK_N=bn, BLOCK_H=bh, num_warps=nw, **map_args(expert_map, ids),
    )  # fmt: skip
    return y


def moe_sparse_masked(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", *,
                      expert_map=None, gate_path="gemv"):  # fmt: skip
    """The "gemv_mask" (gate_path "gemv") or "gemm_mask" path: moe_gate, sparse_mask and the
    compacted up-down kernel. Returns (y [T, n_embd] f32, active count [P] int32)."""
    gate = moe_gate(x, w, fmt, topk_ids, path=gate_path, expert_map=expert_map)
    idx, act, count = sparse_mask(gate, as_threshold(threshold, x.device), activation,
                                  topk_ids=topk_ids, expert_map=expert_map)  # fmt: skip
    y = moe_sparse_up_down(x, w, fmt, topk_ids, topk_w, idx, act, count, expert_map=expert_map)
    return y, count


def moe_sparse_fused(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", *,
                     expert_map=None, blocks=None, bias=None):  # fmt: skip
    """The "fused" path: each (pair, neuron tile) program computes its gate dots, masks, then
    reads only the active neurons' up and down rows (masked loads) and adds into y.
    Returns (y [T, n_embd] f32, active count [P] int32). bias: kernels.moe_args (the
    threshold applies to |act(gate + gate bias)|)."""
    H, _, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map,
                                       bias, generic=True)  # fmt: skip
    P = T * K
    bn, bh, nw, acc2d = blocks or gemv_blocks(fmt, 2, P)
    y, count = zeroed_out_and_count(T, H, P, x.device)
    ids, tw = flat_routing(topk_ids, topk_w)
    _moe_gemv_kernel[(P, triton.cdiv(F, bn))](
        x, w, ids, tw, y, as_threshold(threshold, x.device), count, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACT_CODES[activation], MODE=2, BLOCK_N=bn, BLOCK_H=bh,
        ACC2D=acc2d, num_warps=nw, **map_args(expert_map, ids), **bias_args(bias, tw),
    )  # fmt: skip
    return add_down_bias(y, topk_ids, topk_w, bias, expert_map), count


@triton.jit
def _moe_sparse_down_kernel(
    h_ptr,  # [P, F] f32: act(gate) * up * topk_w of kept neurons, 0 for dropped ones
    w_ptr,  # expert tensor
    ids_ptr,  # [P] expert of each pair
    y_ptr,  # [T, H] f32, accumulated
    H,
    F,
    RB,
    K,
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map (kernels.moe_args)
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # neurons per step
    BLOCK_H: tl.constexpr,  # output columns per program
    SPLIT_N: tl.constexpr,  # neurons per program (a multiple of BLOCK_N)
    HAS_MAP: tl.constexpr,
):
    """y[t, h-chunk] += sum over a SPLIT_N slice of token t's K * F (pair, neuron) rows of
    h * down row; rows with h == 0 are masked off (no memory traffic; the rows of pairs not on
    the device are all 0). Grid (T, H chunks, K * F / SPLIT_N): one atomic per output element
    per program, not per neuron tile."""
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    h = h0 + tl.arange(0, BLOCK_H)
    KF = K * F
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for g0 in range(tl.program_id(2) * SPLIT_N, (tl.program_id(2) + 1) * SPLIT_N, BLOCK_N):
        g = g0 + tl.arange(0, BLOCK_N)  # (slot, neuron) of token t, flattened: k * F + j
        gm = g < KF
        coef = tl.load(h_ptr + t * KF + g, mask=gm, other=0.0)
        e = tl.load(ids_ptr + t * K + g // F, mask=gm, other=0).to(tl.int64)
        if HAS_MAP:
            e = tl.maximum(tl.load(map_ptr + e, mask=gm, other=0).to(tl.int64), 0)
        down_off = ((e * F + g % F) * 3 + 2) * RB
        tile = rows_tile(w_ptr, down_off, gm & (coef != 0.0), h0, H, FMT, BLOCK_H)
        acc += tl.sum(tile * coef[:, None], axis=0)
    tl.atomic_add(y_ptr + t * H + h, acc, mask=h < H, sem="relaxed")


# (BLOCK_N, BLOCK_H, SPLIT_N, num_warps) of the split path's down kernel (H100 sweep, batch 1;
# "block" unswept).
DOWN_CONFIGS = {"float": (64, 512, 128, 4), "block": (32, 256, 256, 4), "packed": (32, 512, 128, 4)}


def down_blocks(fmt: str) -> tuple[int, int, int, int]:
    if interpreting():
        return 32, 64, 64, 4
    return DOWN_CONFIGS[format_family(fmt)]


def moe_sparse_split(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", *,
                     expert_map=None, blocks=None, down=None):  # fmt: skip
    """The "split" path: (1) per (pair, neuron tile) gate dots, mask, up dots of the kept
    neurons -> h [P, n_ff] (0 where dropped); (2) down rows of the kept neurons summed per
    (token, column chunk, neuron slice), one atomic add per output element.
    Returns (y [T, n_embd] f32, active count [P] int32)."""
    H, _, F, rb, T, K = check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map)
    P = T * K
    bn, bh, nw, acc2d = blocks or gemv_blocks(fmt, 3, P)
    dbn, dbh, split, dnw = down or down_blocks(fmt)
    y, count = zeroed_out_and_count(T, H, P, x.device)
    hbuf = torch.empty(P, F, dtype=torch.float32, device=x.device)
    ids, tw = flat_routing(topk_ids, topk_w)
    _moe_gemv_kernel[(P, triton.cdiv(F, bn))](
        x, w, ids, tw, hbuf, as_threshold(threshold, x.device), count, H, F, rb, K, x.stride(0),
        FMT=FMT_CODES[fmt], ACT=ACT_CODES[activation], MODE=3, BLOCK_N=bn, BLOCK_H=bh,
        ACC2D=acc2d, num_warps=nw, **map_args(expert_map, ids), **bias_args(None, tw),
    )  # fmt: skip
    _moe_sparse_down_kernel[(T, triton.cdiv(H, dbh), triton.cdiv(K * F, split))](
        hbuf, w, ids, y, H, F, rb, K, FMT=FMT_CODES[fmt], BLOCK_N=dbn, BLOCK_H=dbh,
        SPLIT_N=split, num_warps=dnw, **map_args(expert_map, ids),
    )  # fmt: skip
    return y, count


SPARSE_LAUNCHERS = {
    "q8r_sparse2": moe_q8r_sparse2,
    "q8r_sparse": moe_q8r_sparse,
    "fused": moe_sparse_fused,
    "split": moe_sparse_split,
    "gemv_mask": functools.partial(moe_sparse_masked, gate_path="gemv"),
    "gemm_mask": functools.partial(moe_sparse_masked, gate_path="gemm"),
}


def moe_sparse(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", path="auto", *,
               expert_map=None, bias=None):  # fmt: skip
    """Sparse routed-expert FFN. Returns (y [T, n_embd] f32, active [T, K] int32 neuron counts;
    0 for pairs whose expert is not on the device).

    threshold: float or [1] device tensor on |act(gate)|; 0 keeps every neuron (= moe_dense).
    path: one of SPARSE_LAUNCHERS (kernels.expert_paths; the q8r ones need q8_0r experts with
    n_embd % 64 == 0 and take the dots on Q8-quantized x) or "auto" (the table's choice for
    T tokens). expert_map, bias: kernels.moe_args (bias: the "fused" path only).
    """
    T, K = topk_ids.shape
    if path == "auto":
        path = table_path(fmt, x.shape[1], T, sparse=True,
                          generic=generic_only(bias, activation))  # fmt: skip
    if path not in SPARSE_LAUNCHERS:
        raise ValueError(f"path must be 'auto' or one of {sorted(SPARSE_LAUNCHERS)}, got {path!r}")
    if bias is not None and path != "fused":
        raise ValueError(f"expert biases run on the generic kernels only (fused), not {path}")
    extra = {} if bias is None else {"bias": bias}
    y, count = SPARSE_LAUNCHERS[path](x, w, fmt, topk_ids, topk_w, threshold, activation,
                                      expert_map=expert_map, **extra)  # fmt: skip
    return y, count.view(T, K)


def moe_sparse_ref(x, w, fmt, topk_ids, topk_w, threshold, activation="silu", q8_x=False,
                   expert_map=None, bias=None):  # fmt: skip
    """Torch reference of moe_sparse: (y [T, n_embd] f32, active [T, K] int32). q8_x: the
    gate/up dots take x quantized to Q8 blocks (quantize_x_q8_ref), as the dp4a path does.
    expert_map: w holds slots; bias: by global id (kernels.moe_args)."""
    T, H = x.shape
    wf = dequantize_experts(w, fmt, H)
    xf = quantize_x_q8_ref(x).float() if q8_x else x.float()
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    active = torch.zeros(topk_ids.shape, dtype=torch.int32, device=x.device)
    for t in range(T):
        for k in range(topk_ids.shape[1]):
            slot = ref_slot(topk_ids, expert_map, t, k)
            if slot < 0:
                continue
            rows = wf[slot]  # [F, 3, H]
            e = int(topk_ids[t, k])
            g, u = rows[:, 0] @ xf[t], rows[:, 1] @ xf[t]
            if bias is not None:
                g, u = g + bias[0][e, :, 0], u + bias[0][e, :, 1]
            a = act_ref(g, activation)
            keep = a.abs() >= threshold
            active[t, k] = int(keep.sum())
            h = torch.where(keep, a * up_ref(u, activation), 0.0)
            out = h @ rows[:, 2]
            if bias is not None:
                out = out + bias[1][e]
            y[t] += float(topk_w[t, k]) * out
    return y, active


def moe_gate_ref(x, w, fmt, topk_ids):
    """Torch reference of moe_gate: [P, n_ff] f32."""
    wf = dequantize_experts(w, fmt, x.shape[1])
    gates = wf[topk_ids.reshape(-1).long(), :, 0]  # [P, F, H]
    xs = x.float().repeat_interleave(topk_ids.shape[1], dim=0)  # [P, H]
    return torch.einsum("pfh,ph->pf", gates, xs)
