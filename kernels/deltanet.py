"""Gated DeltaNet (qwen35moe's linear attention) on the GPU: the decode step as two kernels, the
prefill as the chunked form (pyruntime.model.deltanet: the math and its references).

Decode, one token, after the fused input projection p = x [qkv | z | b | a]^T (one GEMV):
- `conv_step`: per channel c of qkv, y_c = silu(sum_j w[c, j] window_c[j]) over the window of
  the K - 1 cached inputs and this one; the conv state shifts in place. Grid: channel blocks.
- `delta_step`: one program per value head h (key head h // (Hv / Hk)): q, k L2-normalized (q
  scaled by dk^-1/2), beta = sigmoid(b_h), g = A_h softplus(a_h + dt_h); the state S [dk, dv]:
  S = e^g S; u = beta (v - S^T k); S += k u^T; o = S^T q; then the gated RMSNorm
  o = rms_norm(o) * w_norm * silu(z_h), written for the output projection. S in place.
Both read their state at fixed addresses, so a decode step with them is graph-capturable.
A prompt runs the chunked form in torch instead (pyruntime.gpu.deltanet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting

CONV_BLOCK = 256  # channels per program of conv_step


@triton.jit
def _conv_step_kernel(x_ptr, state_ptr, w_ptr, y_ptr, C, K: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    x = tl.load(x_ptr + c, mask=m, other=0.0).to(tl.float32)
    acc = tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0) * x
    for j in tl.static_range(K - 1):
        s = tl.load(state_ptr + c * (K - 1) + j, mask=m, other=0.0)
        acc += tl.load(w_ptr + c * K + j, mask=m, other=0.0) * s
        if j > 0:  # shift: slot j - 1 takes slot j (read above, before any write of this row)
            tl.store(state_ptr + c * (K - 1) + (j - 1), s, mask=m)
    tl.store(state_ptr + c * (K - 1) + (K - 2), x, mask=m)
    tl.store(y_ptr + c, acc / (1.0 + tl.exp(-acc)), mask=m)


def conv_step(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [C] (the token's qkv projection), state [C, K - 1] f32 (updated in place), w [C, K] f32
    -> silu(conv) [C] f32."""
    C, K = w.shape
    y = torch.empty(C, dtype=torch.float32, device=x.device)
    _conv_step_kernel[(triton.cdiv(C, CONV_BLOCK),)](x, state, w, y, C, K, CONV_BLOCK)
    return y


@triton.jit
def _delta_step_kernel(mixed_ptr, proj_ptr, state_ptr, a_ptr, dt_ptr, norm_ptr, out_ptr,
                       z_off, b_off, a_off, HK, HV, DK, DV, eps,
                       BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    kh = h // (HV // HK)
    i = tl.arange(0, BK)
    j = tl.arange(0, BV)
    mi, mj = i < DK, j < DV
    q = tl.load(mixed_ptr + kh * DK + i, mask=mi, other=0.0)
    k = tl.load(mixed_ptr + HK * DK + kh * DK + i, mask=mi, other=0.0)
    v = tl.load(mixed_ptr + 2 * HK * DK + h * DV + j, mask=mj, other=0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) / tl.sqrt(DK.to(tl.float32))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    b = tl.load(proj_ptr + b_off + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-b))
    pre = tl.load(proj_ptr + a_off + h).to(tl.float32) + tl.load(dt_ptr + h)
    softplus = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(pre)))
    decay = tl.exp(tl.load(a_ptr + h) * softplus)
    offs = h * DK * DV + i[:, None] * DV + j[None, :]
    m2 = mi[:, None] & mj[None, :]
    s = tl.load(state_ptr + offs, mask=m2, other=0.0) * decay
    u = (v - tl.sum(k[:, None] * s, axis=0)) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(state_ptr + offs, s, mask=m2)
    o = tl.sum(q[:, None] * s, axis=0)  # [BV]
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
    z = tl.load(proj_ptr + z_off + h * DV + j, mask=mj, other=0.0).to(tl.float32)
    o = o * r * tl.load(norm_ptr + j, mask=mj, other=0.0) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + h * DV + j, o.to(out_ptr.dtype.element_ty), mask=mj)


def delta_step(cfg, mixed: torch.Tensor, proj: torch.Tensor, state: torch.Tensor,
               a: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """One token: mixed [C] f32 (conv output), proj [C + Hv dv + 2 Hv] (the fused projection:
    qkv, z, b, a), state [Hv, dk, dv] f32 (updated in place), a, dt_bias [Hv], norm [dv]
    -> gated, normed output [1, Hv dv] in out_dtype."""
    hk, hv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    C = cfg.ssm_conv_channels
    out = torch.empty((1, hv * dv), dtype=out_dtype, device=mixed.device)
    bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    _delta_step_kernel[(hv,)](
        mixed, proj, state, a, dt_bias, norm, out, C, C + hv * dv, C + hv * dv + hv,
        hk, hv, dk, dv, cfg.rms_eps, bk, bv, num_warps=1 if interpreting() else 4,
    )  # fmt: skip
    return out
