"""MoE routing in one launch: softmax over all experts, top-k, optional renormalization.

    p = softmax(logits[t]);  ids[t] = the k largest p, descending;  w[t] = p[ids]
    (renormalize: w /= sum(w), which equals softmax over the k selected logits)

Same numbers as pyruntime.cpu.experts.route (torch softmax + topk), which took three to four
kernel launches and ~10 µs per layer on an H100 at batch 1 (torch's topk sorts). One program per
token; the k picks are k masked arg-max passes over the n_expert probabilities in registers
(ties: the smaller expert id first).

`add_norm_router` (decode) also does the work before it in the same launch: the residual add,
the FFN RMSNorm and the router GEMV (fp32), spread over programs of BLOCK_E experts each; the
last program to finish (kernels.grid_sync) runs the softmax and top-k. It replaced four launches
per layer (add_rms_norm, cuBLAS GEMV x2, top-k: ~8.7 µs per layer on an H100 at batch 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decoder_ops import residual_rms_norm
from .grid_sync import counters, last_arrival, reset_counter
from .launch import interpreting
from .tuning import lookup

# H100, olmoe shape (64 experts x 2048), graph-timed by bench/gpu_kernels.py: one expert per
# program and one warp (no CTA barriers in the reductions), 5.26 µs a layer (add_rms_norm +
# cuBLAS GEMV + top-k: 7.74 µs).
ROUTER_BLOCK_E, ROUTER_WARPS = 1, 1


@triton.jit
def _router_topk_kernel(logit_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, KP: tl.constexpr,
                        RENORM: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    logits = tl.load(logit_ptr + t * E + e, mask=em, other=float("-inf"))
    _softmax_topk(logits, e, em, ids_ptr + t * K, w_ptr + t * K, K, KP, RENORM, BLOCK_E)


@triton.jit
def _softmax_topk(logits, e, em, ids_ptr, w_ptr, K: tl.constexpr, KP: tl.constexpr,
                  RENORM: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """logits [BLOCK_E] (-inf off the mask em) -> the top K softmax probabilities and ids,
    stored at ids_ptr[0:K], w_ptr[0:K] (KP = next power of two >= K)."""
    z = tl.exp(logits - tl.max(logits, axis=0))
    p = z / tl.sum(z, axis=0)  # [BLOCK_E]; 0 off the mask
    p = tl.where(em, p, -1.0)  # never picked
    j = tl.arange(0, KP)
    top_w = tl.zeros([KP], tl.float32)
    top_i = tl.zeros([KP], tl.int64)
    for i in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        top_w = tl.where(j == i, best, top_w)
        top_i = tl.where(j == i, idx.to(tl.int64), top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(ids_ptr + j, top_i, mask=j < K)
    tl.store(w_ptr + j, top_w, mask=j < K)


def router_topk(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, n_expert] float32 -> (ids [T, k] int64, weights [T, k] float32)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous float32 [T, n_expert], got {logits.dtype}")
    if not 0 < k <= E:
        raise ValueError(f"k must be in 1..{E}, got {k}")
    ids = torch.empty(T, k, device=logits.device, dtype=torch.int64)
    w = torch.empty(T, k, device=logits.device, dtype=torch.float32)
    _router_topk_kernel[(T,)](
        logits, ids, w, E, K=k, KP=triton.next_power_of_2(k), RENORM=renormalize,
        BLOCK_E=triton.next_power_of_2(E),
        num_warps=1,
    )  # fmt: skip
    return ids, w


# ----------------------------------------------------------------------------------------------
# decode: residual add + RMSNorm + router GEMV + softmax + top-k, one launch


@triton.jit
def _norm_router_kernel(x_ptr, d_ptr, nw_ptr, r_ptr, rb_ptr, xo_ptr, h_ptr, h32_ptr, logit_ptr,
                        cnt_ptr, ids_ptr, w_ptr, E, H, alpha, eps, HAS_DELTA: tl.constexpr,
                        HAS_F32: tl.constexpr, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                        KP: tl.constexpr,
                        RENORM: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_ALL: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BLOCK_H)
    cm = c < H
    # Every program recomputes the norm of token t (H floats from L2): no launch in between.
    x, h = residual_rms_norm(x_ptr, d_ptr, nw_ptr, t, c, cm, H, alpha, eps, HAS_DELTA)
    if pid == 0:  # the new residual and the normed input of the experts
        tl.store(xo_ptr + t * H + c, x, mask=cm)
        tl.store(h_ptr + t * H + c, h.to(h_ptr.dtype.element_ty), mask=cm)
        if HAS_F32:
            tl.store(h32_ptr + t * H + c, h, mask=cm)
    e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < E
    wr = tl.load(r_ptr + e[:, None] * H + c[None, :], mask=em[:, None] & cm[None, :], other=0.0)
    logit = tl.sum(wr * h[None, :], axis=1)  # [BLOCK_E] f32
    if HAS_BIAS:
        logit += tl.load(rb_ptr + e, mask=em, other=0.0)
    tl.store(logit_ptr + t * E + e, logit, mask=em)
    if last_arrival(cnt_ptr + t, tl.num_programs(0)):
        ea = tl.arange(0, BLOCK_ALL)
        eam = ea < E
        logits = tl.load(logit_ptr + t * E + ea, mask=eam, other=float("-inf"),
                         cache_modifier=".cg")  # fmt: skip
        _softmax_topk(logits, ea, eam, ids_ptr + t * K, w_ptr + t * K, K, KP, RENORM, BLOCK_ALL)
        reset_counter(cnt_ptr + t)


def add_norm_router(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_w: torch.Tensor,
    router_w: torch.Tensor,
    eps: float,
    k: int,
    renormalize: bool,
    out_dtype: torch.dtype,
    alpha: float = 1.0,
    want_f32: bool = False,
    block_e: int | None = None,
    num_warps: int | None = None,
    router_bias: torch.Tensor | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """The FFN sub-block's head for a few tokens (decode), in one launch:
    x1 = x + alpha * delta; h = rms_norm(x1) * norm_w; logits = h @ router_w^T (fp32)
    (+ router_bias [E] f32, gpt-oss); softmax, top-k, optional renormalization (as router_topk).

    x [T, H] f32 contiguous (not modified); delta [T, H] or None; norm_w [H] f32; router_w
    [E, H] f32. Returns (x1 [T, H] f32 (a new tensor), h [T, H] out_dtype, h f32 or None,
    ids [T, k] int64, weights [T, k] f32, logits [T, E] f32). No host synchronization
    (graph-capturable).
    block_e, num_warps: experts per program and warps (default ROUTER_BLOCK_E, ROUTER_WARPS,
    or the kernels.tuning overrides)."""
    T, H = x.shape
    E = router_w.shape[0]
    if x.dtype != torch.float32 or not x.is_contiguous() or norm_w.shape != (H,):
        raise ValueError(f"x must be contiguous float32 [T, H] and norm_w [H], got {x.dtype} "
                         f"{list(x.shape)}, {list(norm_w.shape)}")  # fmt: skip
    if router_w.shape != (E, H) or router_w.dtype != torch.float32 or not router_w.is_contiguous():
        raise ValueError(f"router_w must be contiguous float32 [E, {H}]")
    if delta is not None and (delta.shape != x.shape or not delta.is_contiguous()):
        raise ValueError(f"delta must be contiguous {list(x.shape)}, got {list(delta.shape)}")
    if not 0 < k <= E:
        raise ValueError(f"k must be in 1..{E}, got {k}")
    bias_ok = router_bias is None or (
        router_bias.shape == (E,) and router_bias.dtype == torch.float32
    )
    if not bias_ok:
        raise ValueError(f"router_bias must be float32 [{E}]")
    dev = x.device
    x1 = torch.empty_like(x)
    h = torch.empty(T, H, device=dev, dtype=out_dtype)
    h32 = torch.empty(T, H, device=dev, dtype=torch.float32) if want_f32 else None
    logits = torch.empty(T, E, device=dev, dtype=torch.float32)
    ids = torch.empty(T, k, device=dev, dtype=torch.int64)
    w = torch.empty(T, k, device=dev, dtype=torch.float32)
    block_e = 16 if interpreting() else (block_e or lookup("router_block_e") or ROUTER_BLOCK_E)
    num_warps = 1 if interpreting() else (num_warps or lookup("router_warps") or ROUTER_WARPS)
    _norm_router_kernel[(triton.cdiv(E, block_e), T)](
        x, x if delta is None else delta, norm_w, router_w,
        norm_w if router_bias is None else router_bias, x1, h, h if h32 is None else h32,
        logits, counters(dev, T), ids, w, E, H, alpha, eps, HAS_DELTA=delta is not None,
        HAS_F32=want_f32, HAS_BIAS=router_bias is not None, K=k, KP=triton.next_power_of_2(k),
        RENORM=renormalize,
        BLOCK_E=block_e,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_ALL=triton.next_power_of_2(E),
        num_warps=num_warps,
    )  # fmt: skip
    return x1, h, h32, ids, w, logits


def add_norm_router_ref(x, delta, norm_w, router_w, eps, k, renormalize, out_dtype, alpha=1.0,
                        router_bias=None):  # fmt: skip
    """Plain torch: (x1, h in out_dtype, h f32, ids, weights, logits) as the unfused CPU
    model."""
    x1 = x if delta is None else x + alpha * delta.float()
    h32 = x1 * torch.rsqrt(x1.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    logits = h32 @ router_w.T
    if router_bias is not None:
        logits = logits + router_bias
    ids, w = router_topk_ref(logits, k, renormalize)
    return x1, h32.to(out_dtype), h32, ids, w, logits


def router_topk_ref(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch routing: softmax over all experts, top-k, optional renormalization.
    logits [T, n_expert] -> (ids [T, k] int64, weights [T, k] f32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w
