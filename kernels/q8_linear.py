"""Dense Q8_0 weights on the GPU without a dequantized copy: y = x @ W^T (+ b) for decode.

The GGUF Q8_0 rows of a dense weight W [N, K] (34-byte blocks: f16 scale d, 32 int8 quants q,
W[n, 32 b + i] = d[n, b] * q[n, 32 b + i]) are split once at load into two aligned arrays,
q int8 [N, K] and d f16 [N, K / 32] (`split_q8_0`; the same 34 bytes per 32 weights, read with
wide loads). A decode step reads 1.0625 bytes per weight instead of bf16's 2.

`q8_gemv`: one program per (BLOCK_N rows, token): for each K chunk (one chunk for K <= 2048),
the 32-element block sums of q * x (fp32, [BLOCK_N, BLOCK_K / 32, 32] tiles; the int8 quants
are loaded as bytes and turned into floats by the mantissa trick of kernels.expert_rows, not by
the quarter-rate I2F unit), times the block scales, accumulated in fp32.
`q8_gemm` (prefill, more tokens): a tiled GEMM whose W tiles are dequantized in registers
(q * d in fp32, then the dot dtype) and fed to tensor cores (bf16 / f16 x; fp32 accumulation),
never a dequantized copy of W; exact fp32 dots for f32 x and under the interpreter.
`dequantize_q8` is the reference's and the "cublas" comparison's (bench/gpu_prefill.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_rows import s8_to_f32
from .launch import dot_code, interpreting
from .tuning import lookup


def split_q8_0(raw: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 bytes uint8 [N, K / 32 * 34] -> (q int8 [N, K], d float16 [N, K / 32])."""
    N = raw.shape[0]
    if n_cols % 32 or raw.shape[1] != n_cols // 32 * 34 or raw.dtype != torch.uint8:
        raise ValueError(f"Q8_0 rows of {n_cols} weights are {n_cols // 32 * 34} bytes (uint8)")
    blocks = raw.reshape(N, n_cols // 32, 34)
    d = blocks[:, :, :2].contiguous().view(torch.float16).reshape(N, n_cols // 32)
    q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(N, n_cols)
    return q, d


def q4_0_as_q8_0(raw: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 bytes uint8 [N, K / 32 * 18] -> the same weights as Q8_0 (q int8 [N, K], d
    float16 [N, K / 32]): exact (a Q4_0 block is d times codes in -8..7, its 16 bytes holding
    elements j and j + 16 in the low and high nibble of byte j), for the Q8_0 kernels: half the
    bytes a bf16 copy would read, and no rounding of d * code to bf16."""
    N = raw.shape[0]
    if n_cols % 32 or raw.shape[1] != n_cols // 32 * 18 or raw.dtype != torch.uint8:
        raise ValueError(f"Q4_0 rows of {n_cols} weights are {n_cols // 32 * 18} bytes (uint8)")
    blocks = raw.reshape(N, n_cols // 32, 18)
    d = blocks[:, :, :2].contiguous().view(torch.float16).reshape(N, n_cols // 32)
    qs = blocks[:, :, 2:].to(torch.int16)
    q = torch.cat([(qs & 15) - 8, (qs >> 4) - 8], dim=-1).to(torch.int8).reshape(N, n_cols)
    return q, d


def dequantize_q8(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [N, K], d [N, K / 32]) -> W [N, K] in dtype (the exact products, then rounded)."""
    N, K = q.shape
    w = q.view(N, K // 32, 32).float() * d.float()[:, :, None]
    return w.reshape(N, K).to(dtype)


@triton.jit
def _q8_gemv_kernel(x_ptr, q_ptr, d_ptr, b_ptr, y_ptr, N, K, KB, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    NB: tl.constexpr = BLOCK_K // 32
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    n64 = n.to(tl.int64)
    b = tl.arange(0, NB)
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, NB], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 32 + b  # [NB] block index
        bm = kb < KB
        k = kb[:, None] * 32 + i[None, :]  # [NB, 32]
        x = tl.load(x_ptr + t * K + k, mask=bm[:, None], other=0.0).to(tl.float32)
        m3 = nm[:, None, None] & bm[None, :, None]
        # quant bytes (uint8 view) -> fp32 by the mantissa trick: no I2F (quarter rate)
        qv = tl.load(q_ptr + n64[:, None, None] * K + k[None, :, :], mask=m3, other=0x80)
        s = tl.sum(s8_to_f32(qv) * x[None, :, :], axis=2)  # [BLOCK_N, NB] block sums
        dv = tl.load(d_ptr + n64[:, None] * KB + kb[None, :],
                     mask=nm[:, None] & bm[None, :], other=0.0)  # fmt: skip
        acc += s * dv.to(tl.float32)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * N + n, y.to(y_ptr.dtype.element_ty), mask=nm)


def gemv_config(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N rows per program, BLOCK_K, num_warps), or the tuning file's for N x K. A whole
    row of K <= 2048 in one pass (no loop: every load of the program in flight at once); rows
    per program grow with N so that there are ~500-3000 programs (an H100 has 132 SMs). H100,
    graph-timed per layer by bench/gpu_kernels.py (16 layers' weights, bf16 x): [6144 x 2048]
    (8, 2048, 4) 9.3 µs, [2048 x 2048] (2, 2048, 8) 4.9 µs, [50304 x 2048] (16, 1024, 4)
    50.4 µs. (Folding the residual add + RMSNorm into the qkv GEMV's prologue took 12.4 µs a
    layer against 11.4 µs for a norm launch + the GEMV: every program re-reads the three
    K-float vectors; dropped.)"""
    if interpreting():
        return 128, 256, 1  # few programs: the interpreter runs each
    tuned = lookup("q8_gemv", f"{N}x{K}")
    if tuned is not None:
        return tuple(tuned)
    block_k = min(2048, triton.next_power_of_2(K))
    if N <= 4096:
        return 2, block_k, 8
    if N <= 16384:
        return 8, block_k, 4
    return 16, min(block_k, 1024), 4


@triton.jit
def _q8_gemm_kernel(x_ptr, q_ptr, d_ptr, b_ptr, y_ptr, M, N, K, KB, stride_x,
                    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):  # fmt: skip
    """y [M, N] = x [M, K] @ W^T (+ b), W = q * d by 32-blocks. Programs walk GROUP_M row
    tiles per column tile (the W tile is reused from L2 by GROUP_M programs in a row)."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = m < M, n < N
    m64, n64 = m.to(tl.int64), n.to(tl.int64)
    NB: tl.constexpr = BLOCK_K // 32
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 32 + tl.arange(0, NB)  # [NB] block index
        bm = kb < KB
        k = kb[:, None] * 32 + i[None, :]  # [NB, 32]
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m64[:, None] * stride_x + kk[None, :],
                    mask=mm[:, None] & (kk < K)[None, :], other=0.0)  # fmt: skip
        qv = tl.load(q_ptr + n64[:, None, None] * K + k[None, :, :],
                     mask=nm[:, None, None] & bm[None, :, None], other=0x80)  # fmt: skip
        dv = tl.load(d_ptr + n64[:, None] * KB + kb[None, :], mask=nm[:, None] & bm[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        w = tl.reshape(s8_to_f32(qv) * dv[:, :, None], [BLOCK_N, BLOCK_K])
        if DOT == 1:
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        elif DOT == 2:
            acc = tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + m64[:, None] * N + n64[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of q8_gemm: the Triton matmul
# tutorial's large-tile config for H100-class GPUs, BLOCK_M halved for short batches (fewer
# padded rows). Not timed on a GPU yet: bench/gpu_prefill.py times it against dequantize +
# cuBLAS at pp128 / pp512 / pp2048 shapes.
GEMM_CONFIGS = {"short": (64, 128, 64, 8, 4, 4), "long": (128, 128, 64, 8, 8, 3)}


def gemm_config(M: int) -> tuple[int, int, int, int, int, int]:
    """q8_gemm's config for M rows (GEMM_CONFIGS; small tiles under the interpreter)."""
    if interpreting():
        return 16, 32, 64, 4, 4, 1
    return GEMM_CONFIGS["short" if M <= 64 else "long"]


# Prompt lengths up to which q8_gemm beat dequantize + cuBLAS on an H100 (olmoe-1b-7b's q/k/v,
# o and lm_head, bench/gpu_prefill.py: 1.12-6.1x at 128 and 512 tokens, 0.85-0.95x at 2048).
Q8_GEMM_MAX_TOKENS = 512


def q8_gemm_max_tokens() -> int:
    """Tokens up to which Q8_0 prefill matmuls take q8_gemm (above: dequantize + cuBLAS): the
    tuning file's "q8_gemm": {"max_tokens": N}, else Q8_GEMM_MAX_TOKENS."""
    tuned = lookup("q8_gemm", "max_tokens")
    return int(tuned) if tuned is not None else Q8_GEMM_MAX_TOKENS


def q8_gemm(
    x: torch.Tensor,
    q: torch.Tensor,
    d: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (f32/bf16/f16, rows at any stride, unit column stride) -> y [M, N] in out_dtype
    (default x's), fp32 accumulation; tensor cores for half x (kernels.moe_dense.dot_code).
    config: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), default gemm_config."""
    _check(x, q, d, strided_rows=True)
    M, K = x.shape
    N = q.shape[0]
    out_dtype = out_dtype or x.dtype
    # The interpreter's cast to bf16 truncates (a GPU rounds to nearest): fp32 out, torch casts.
    y_dtype = torch.float32 if interpreting() else out_dtype
    y = torch.empty(M, N, device=x.device, dtype=y_dtype)
    bm, bn, bk, group, warps, stages = config or gemm_config(M)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _q8_gemm_kernel[grid](
        x, q.view(torch.uint8), d, y if bias is None else bias, y, M, N, K, K // 32, x.stride(0),
        HAS_BIAS=bias is not None, DOT=dot_code(x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y.to(out_dtype)


def _check(x, q, d, strided_rows=False):
    T, K = x.shape
    N = q.shape[0]
    dense = x.stride(1) == 1 if strided_rows else x.is_contiguous()
    if q.shape != (N, K) or d.shape != (N, K // 32) or not dense:
        raise ValueError(f"x [T, K] contiguous, q [N, K], d [N, K/32]: got x {list(x.shape)}, "
                         f"q {list(q.shape)}, d {list(d.shape)}")  # fmt: skip


def q8_gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    d: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [T, K] (f32/bf16, small T) -> y [T, N] in out_dtype (default x's), fp32 accumulation.
    config: (BLOCK_N, BLOCK_K, num_warps), default gemv_config(N, K)."""
    _check(x, q, d)
    T, K = x.shape
    N = q.shape[0]
    y = torch.empty(T, N, device=x.device, dtype=out_dtype or x.dtype)
    block_n, block_k, warps = config or gemv_config(N, K)
    _q8_gemv_kernel[(triton.cdiv(N, block_n), T)](
        x, q.view(torch.uint8), d, y if bias is None else bias, y, N, K, K // 32,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return y


def q8_linear_ref(x, q, d, bias=None):
    """Plain torch, fp32: x @ dequantize(q, d)^T (+ bias)."""
    y = x.float() @ dequantize_q8(q, d, torch.float32).T
    return y if bias is None else y + bias.float()
