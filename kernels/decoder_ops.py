"""Fused pointwise pieces of a decoder block, so a decode step is a few launches per layer.

- `add_rms_norm`: x += alpha * delta (the residual add, in place, x float32), then
  h = rms_norm(x) * w written in the matmul dtype (and optionally also in float32, for the
  router). One program per token row.
- `qk_rope_store`: from the fused q/k/v projection output, q/k RMSNorm (none, over all heads as
  OLMoE, or per head as Qwen3-MoE), rotary embedding (HF rotate_half on the first rope_dim dims
  of each head), optional clamp; writes q [n_head, n, D] for attention, and k, v into the KV
  cache at each token's position (read from a device tensor, so decode is graph-capturable).
  Llama-4's layers: q/k L2 norm per head after rope (no weight), or no rope and q scaled by the
  temperature of its position (NoPE layers), both computed from that position in the kernel.
  Grid (n tokens, 3): program 0 does q, 1 does k, 2 copies v.
- `shared_gate_add`: a MoE layer's output y + sigmoid(h . w_gate) * s, the routed experts' y
  plus the shared expert's s under its sigmoid gate (Qwen2-MoE, Qwen3.5-MoE): one launch for
  the gate's dot, the sigmoid, the product and the sum. One program per token row.
Each has a plain torch reference beside it (`*_ref`) for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting
from .tuning import lookup

# ----------------------------------------------------------------------------------------------
# residual add + RMSNorm


@triton.jit
def residual_rms_norm(x_ptr, d_ptr, w_ptr, row, c, m, H, alpha, eps, HAS_DELTA: tl.constexpr):
    """(x, h) [BLOCK_H] f32 of token `row`: x = x + alpha * delta (HAS_DELTA), h = rms_norm(x) * w
    over the H columns c (mask m). Shared by every launch that starts with the residual + norm."""
    x = tl.load(x_ptr + row * H + c, mask=m, other=0.0)
    if HAS_DELTA:
        x = x + alpha * tl.load(d_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    return x, x * r * tl.load(w_ptr + c, mask=m, other=0.0)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, h32_ptr, H, alpha, eps,
                         HAS_DELTA: tl.constexpr, HAS_F32: tl.constexpr,
                         BLOCK_H: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_H)
    m = c < H
    x, h = residual_rms_norm(x_ptr, d_ptr, w_ptr, row, c, m, H, alpha, eps, HAS_DELTA)
    if HAS_DELTA:
        tl.store(x_ptr + row * H + c, x, mask=m)
    tl.store(h_ptr + row * H + c, h.to(h_ptr.dtype.element_ty), mask=m)
    if HAS_F32:
        tl.store(h32_ptr + row * H + c, h, mask=m)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    alpha: float = 1.0,
    want_f32: bool = False,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [n, H] float32 contiguous, updated in place to x + alpha * delta (delta [n, H] any
    float dtype, or None); returns (rms_norm(x) * w in out_dtype, the same in float32 or None)."""
    n, H = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous() or w.shape != (H,):
        raise ValueError(f"x must be contiguous float32 [n, H] and w [H], got {x.dtype} "
                         f"{list(x.shape)}, w {list(w.shape)}")  # fmt: skip
    if delta is not None and (delta.shape != x.shape or not delta.is_contiguous()):
        raise ValueError(f"delta must be contiguous {list(x.shape)}, got {list(delta.shape)}")
    h = torch.empty(n, H, device=x.device, dtype=out_dtype)
    h32 = torch.empty(n, H, device=x.device, dtype=torch.float32) if want_f32 else None
    _add_rms_norm_kernel[(n,)](
        x, x if delta is None else delta, w, h, h if h32 is None else h32, H, alpha, eps,
        HAS_DELTA=delta is not None, HAS_F32=want_f32, BLOCK_H=triton.next_power_of_2(H),
        num_warps=1 if interpreting() else (num_warps or lookup("norm_warps") or 4),
    )  # fmt: skip
    return h, h32


def add_rms_norm_ref(x, delta, w, eps, out_dtype, alpha=1.0):
    """(new x, h) in plain torch; x is not modified."""
    x = x if delta is None else x + alpha * delta.float()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return x, h.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# shared expert under its sigmoid gate, added to the routed experts' output


@triton.jit
def _shared_gate_add_kernel(y_ptr, s_ptr, h_ptr, g_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_H)
    m = c < H
    h = tl.load(h_ptr + row * H + c, mask=m, other=0.0)
    logit = tl.sum(h * tl.load(g_ptr + c, mask=m, other=0.0), axis=0)
    gate = 1.0 / (1.0 + tl.exp(-logit))
    s = tl.load(s_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * H + c, mask=m, other=0.0)
    tl.store(out_ptr + row * H + c, y + gate * s, mask=m)


def shared_gate_add(y: torch.Tensor, s: torch.Tensor, h32: torch.Tensor,
                    gate: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """y [n, H] f32 (the routed experts' output), s [n, H] any float dtype (the shared
    expert's), h32 [n, H] f32 (the FFN input), gate [H] f32 -> y + sigmoid(h32 @ gate)[:, None]
    * s, a new [n, H] f32 tensor. All contiguous."""
    n, H = y.shape
    if not all(t.shape == (n, H) and t.is_contiguous() for t in (y, s, h32)) or gate.shape != (H,):
        raise ValueError(f"y, s, h32 must be contiguous [n, H] and gate [H], got "
                         f"{[list(t.shape) for t in (y, s, h32, gate)]}")  # fmt: skip
    out = torch.empty_like(y)
    _shared_gate_add_kernel[(n,)](
        y, s, h32, gate, out, H, BLOCK_H=triton.next_power_of_2(H),
        num_warps=1 if interpreting() else 4,
    )  # fmt: skip
    return out


def shared_gate_add_ref(y, s, h32, gate):
    return y + torch.sigmoid(h32 @ gate)[:, None] * s.float()


# ----------------------------------------------------------------------------------------------
# q/k norm + rope + KV cache store

NORM_NONE, NORM_ALL_HEADS, NORM_PER_HEAD = 0, 1, 2


@triton.jit
def _qk_rope_store_kernel(qkv_ptr, q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                          n_tok, S, eps, clamp, temp_len, temp_scale, NH: tl.constexpr,
                          NKV: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                          NORM: tl.constexpr, CLAMP: tl.constexpr, L2: tl.constexpr,
                          TEMP: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                          BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    which = tl.program_id(1)  # 0: q, 1: k, 2: v
    heads = tl.where(which == 0, NH, NKV)
    col0 = tl.where(which == 0, 0, tl.where(which == 1, NH * D, (NH + NKV) * D))
    hh = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    m = (hh < heads)[:, None] & (d < D)[None, :]
    row = qkv_ptr + t.to(tl.int64) * ((NH + 2 * NKV) * D) + col0
    x = tl.load(row + hh[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    half: tl.constexpr = ROPE // 2
    if which < 2:
        # rotate_half partner of dim d (inside the rotated part): d + half or d - half
        pd = tl.where(d < half, d + half, d - half)
        pd = tl.where(d < ROPE, pd, d)
        xp = tl.load(row + hh[:, None] * D + pd[None, :], mask=m, other=0.0).to(tl.float32)
        if CLAMP:
            x = tl.minimum(tl.maximum(x, -clamp), clamp)
            xp = tl.minimum(tl.maximum(xp, -clamp), clamp)
        if NORM != 0:
            nw_ptr = qn_ptr if which == 0 else kn_ptr
            if NORM == 1:  # over all heads: weight [heads * D]
                r = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (heads * D) + eps)
                w_off = hh[:, None] * D
                x = x * r * tl.load(nw_ptr + w_off + d[None, :], mask=m, other=0.0)
                xp = xp * r * tl.load(nw_ptr + w_off + pd[None, :], mask=m, other=0.0)
            else:  # per head: weight [D]
                r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_HEADS]
                x = x * r[:, None] * tl.load(nw_ptr + d, mask=d < D, other=0.0)[None, :]
                xp = xp * r[:, None] * tl.load(nw_ptr + pd, mask=d < D, other=0.0)[None, :]
        in_rope = d < ROPE
        cos = tl.load(cos_ptr + pos * ROPE + d, mask=in_rope, other=1.0)
        sin = tl.load(sin_ptr + pos * ROPE + d, mask=in_rope, other=0.0)
        sign = tl.where(d < half, -1.0, 1.0)
        rot = x * cos[None, :] + (sign * sin)[None, :] * xp
        x = tl.where(in_rope[None, :], rot, x)
        if L2:  # llama4's rope layers: x * rsqrt(mean(x^2) + eps) per head, after rope
            x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        if TEMP:  # llama4's NoPE layers: q * (1 + scale log(1 + floor((pos + 1) / length)))
            if which == 0:
                steps = ((pos + 1) // temp_len).to(tl.float32)
                x = x * (tl.log(1.0 + steps) * temp_scale + 1.0)
    elif CLAMP:
        x = tl.minimum(tl.maximum(x, -clamp), clamp)
    if which == 0:  # q [NH, n_tok, D]
        dst = q_ptr + (hh[:, None] * n_tok + t) * D + d[None, :]
        tl.store(dst, x.to(q_ptr.dtype.element_ty), mask=m)
    else:  # cache [2, NKV, S, D]
        base = (which - 1) * NKV * S * D
        dst = kv_ptr + base + (hh[:, None] * S + pos) * D + d[None, :]
        tl.store(dst, x.to(kv_ptr.dtype.element_ty), mask=m)


def qk_rope_store(
    qkv: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_head: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    clamp: float | None = None,
    num_warps: int | None = None,
    *,
    rope: bool = True,
    l2_norm: bool = False,
    temperature: tuple[int, float] | None = None,
) -> torch.Tensor:
    """qkv [n, (n_head + 2 n_kv) * D] (q, k, v columns); kv cache of one layer [2, n_kv, S, D];
    positions [n] int64 device tensor; cos, sin [S, rope_dim] float32 (rotate_half tables);
    q_norm/k_norm: None, [heads * D] (norm over all heads) or [D] (per head).
    rope=False: no rotation (llama4's NoPE layers); l2_norm: q and k scaled per head by
    rsqrt(mean(x^2) + eps) after rope; temperature (length, scale): q times
    1 + scale log(1 + floor((pos + 1) / length)).
    Writes k, v at kv[:, :, positions]; returns q [n_head, n, D] in kv's dtype (rotated)."""
    n = qkv.shape[0]
    _, n_kv, S, D = kv.shape
    rope_dim = cos.shape[1]
    if qkv.shape[1] != (n_head + 2 * n_kv) * D or not qkv.is_contiguous() or not kv.is_contiguous():
        raise ValueError(f"qkv must be contiguous [n, {(n_head + 2 * n_kv) * D}], kv contiguous "
                         f"[2, n_kv, S, D]; got {list(qkv.shape)}, {list(kv.shape)}")  # fmt: skip
    if positions.shape != (n,) or cos.shape != sin.shape or cos.shape[0] < S or rope_dim > D:
        raise ValueError("positions must be [n]; cos, sin [>= S, rope_dim <= D]")
    norm = NORM_NONE
    if q_norm is not None:
        norm = NORM_PER_HEAD if q_norm.numel() == D else NORM_ALL_HEADS
    q = torch.empty(n_head, n, D, device=qkv.device, dtype=kv.dtype)
    temp_len, temp_scale = temperature or (1, 0.0)
    _qk_rope_store_kernel[(n, 3)](
        qkv, q, kv, positions, cos, sin, q if q_norm is None else q_norm,
        q if k_norm is None else k_norm, n, S, eps, 0.0 if clamp is None else clamp,
        temp_len, temp_scale, NH=n_head, NKV=n_kv, D=D, ROPE=rope_dim if rope else 0,
        NORM=norm, CLAMP=clamp is not None, L2=l2_norm, TEMP=temperature is not None,
        BLOCK_HEADS=triton.next_power_of_2(max(n_head, n_kv)),
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if interpreting() else (num_warps or lookup("rope_warps") or 4),
    )  # fmt: skip
    return q


def qk_rope_store_ref(qkv, kv, positions, cos, sin, n_head, q_norm=None, k_norm=None, eps=1e-6,
                      clamp=None, rope=True, l2_norm=False, temperature=None):  # fmt: skip
    """Plain torch (the CPU model's math): returns (q [n_head, n, D] f32, new kv)."""
    n = qkv.shape[0]
    _, n_kv, S, D = kv.shape
    q, k, v = qkv.float().split([n_head * D, n_kv * D, n_kv * D], dim=1)
    if clamp is not None:
        q, k, v = (t.clamp(-clamp, clamp) for t in (q, k, v))

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    per_head = q_norm is not None and q_norm.numel() == D
    if q_norm is not None and not per_head:
        q, k = norm(q, q_norm), norm(k, k_norm)
    q = q.view(n, n_head, D).transpose(0, 1)
    k = k.view(n, n_kv, D).transpose(0, 1)
    v = v.view(n, n_kv, D).transpose(0, 1)
    if per_head:
        q, k = norm(q, q_norm), norm(k, k_norm)
    c, s = cos[positions], sin[positions]  # [n, rope]
    r = c.shape[1]

    def rotate(x):
        xr, xp = x[..., :r], x[..., r:]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        return torch.cat([xr * c + torch.cat([-x2, x1], dim=-1) * s, xp], dim=-1)

    if rope:
        q, k = rotate(q), rotate(k)
    if l2_norm:
        q, k = norm(q, 1.0), norm(k, 1.0)
    if temperature is not None:
        steps = torch.floor((positions.float() + 1.0) / temperature[0])
        q = q * (torch.log1p(steps) * temperature[1] + 1.0)[None, :, None]
    kv = kv.clone()
    kv[0][:, positions] = k.to(kv.dtype)
    kv[1][:, positions] = v.to(kv.dtype)
    return q, kv
