"""Gated DeltaNet (qwen35moe's linear attention) on the GPU: the decode step as one kernel, the
prefill in kernels.deltanet_chunk (pyruntime.model.deltanet: the math and its references).

Decode, one token, after the fused input projection p = x [qkv | z | b | a]^T (one GEMV):
`_decode_kernel`, one program per value head h (key head kh = h // (Hv / Hk)):
- the causal conv step of the channels it reads: y_c = silu(sum_j w[c, j] window_c[j]) over the
  K - 1 cached inputs and this one, for kh's q and k channels and h's v channels;
- q, k L2-normalized (q scaled by dk^-1/2), beta = sigmoid(b_h), g = A_h softplus(a_h + dt_h);
  the state S [dk, dv]: S = e^g S; u = beta (v - S^T k); S += k u^T; o = S^T q; then the gated
  RMSNorm o = rms_norm(o) * w_norm * silu(z_h), written for the output projection;
- the conv state shifted in place: h's v channels by h itself; kh's q and k channels, which the
  Hv / Hk programs of kh all read, by the last of them to arrive (kernels.grid_sync), after the
  others' reads.
S and the conv state are read at fixed addresses, so a decode step with it is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_sync import counters, last_arrival, reset_counter
from .launch import interpreting


@triton.jit
def _conv_read(proj_ptr, conv_ptr, w_ptr, c, m, K: tl.constexpr):
    """(silu(conv) of channels c with this token's input, that input), the state unchanged."""
    x = tl.load(proj_ptr + c, mask=m, other=0.0).to(tl.float32)
    acc = tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0) * x
    for j in tl.static_range(K - 1):
        s = tl.load(conv_ptr + c * (K - 1) + j, mask=m, other=0.0)
        acc += tl.load(w_ptr + c * K + j, mask=m, other=0.0) * s
    return acc / (1.0 + tl.exp(-acc)), x


@triton.jit
def _conv_shift(conv_ptr, c, m, x, K: tl.constexpr):
    """The state of channels c after input x: slot j - 1 takes slot j, the last slot x."""
    for j in tl.static_range(1, K - 1):
        s = tl.load(conv_ptr + c * (K - 1) + j, mask=m, other=0.0)
        tl.store(conv_ptr + c * (K - 1) + (j - 1), s, mask=m)
    tl.store(conv_ptr + c * (K - 1) + (K - 2), x, mask=m)


@triton.jit
def _decode_kernel(proj_ptr, conv_ptr, convw_ptr, state_ptr, a_ptr, dt_ptr, norm_ptr, out_ptr,
                   cnt_ptr, z_off, b_off, a_off, HK, DK, DV, eps, GROUP: tl.constexpr,
                   K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    kh = h // GROUP
    i = tl.arange(0, BK)
    j = tl.arange(0, BV)
    mi, mj = i < DK, j < DV
    cq, ck, cv = kh * DK + i, HK * DK + kh * DK + i, 2 * HK * DK + h * DV + j
    q, xq = _conv_read(proj_ptr, conv_ptr, convw_ptr, cq, mi, K)
    k, xk = _conv_read(proj_ptr, conv_ptr, convw_ptr, ck, mi, K)
    v, xv = _conv_read(proj_ptr, conv_ptr, convw_ptr, cv, mj, K)
    tl.debug_barrier()  # this program's reads of its v channels' state before their shift
    _conv_shift(conv_ptr, cv, mj, xv, K)
    if last_arrival(cnt_ptr + kh, GROUP):  # every program of kh has read q's and k's state
        _conv_shift(conv_ptr, cq, mi, xq, K)
        _conv_shift(conv_ptr, ck, mi, xk, K)
        reset_counter(cnt_ptr + kh)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) / tl.sqrt(DK.to(tl.float32))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    b = tl.load(proj_ptr + b_off + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-b))
    pre = tl.load(proj_ptr + a_off + h).to(tl.float32) + tl.load(dt_ptr + h)
    softplus = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))
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


def decode_step(cfg, proj: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor,
                state: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """One token: proj [C + Hv dv + 2 Hv] (the fused projection: qkv, z, b, a), conv_state
    [C, K - 1] and state [Hv, dk, dv] f32 (both advanced in place), conv_w [C, K] f32, a,
    dt_bias [Hv], norm [dv] -> gated, normed output [1, Hv dv] in out_dtype."""
    hk, hv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    C, K = conv_w.shape
    assert proj.is_contiguous() and conv_state.is_contiguous() and state.is_contiguous()
    out = torch.empty((1, hv * dv), dtype=out_dtype, device=proj.device)
    bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    _decode_kernel[(hv,)](
        proj, conv_state, conv_w, state, a, dt_bias, norm, out, counters(proj.device, hk),
        C, C + hv * dv, C + hv * dv + hv, hk, dk, dv, cfg.rms_eps, hv // hk, K, bk, bv,
        num_warps=1 if interpreting() else 4,
    )  # fmt: skip
    return out
