"""Gated DeltaNet over a prompt on the GPU: the chunked form (pyruntime.model.deltanet.chunked,
the WY / UT-transform form of the flash-linear-attention papers) in four kernels, fp32 state.

For T tokens after the fused input projection proj [T, C + Hv dv + 2 Hv] (qkv, z, b, a):
- `_conv_kernel`: the causal depthwise conv over the T tokens after the K - 1 cached inputs,
  silu -> mixed [T, C] f32; the conv state then holds the last K - 1 inputs. Grid: channel
  blocks, each walking the tokens (a program owns its channels' state: read first, written
  last, no other program touches it).
- `_prep_kernel`: per (chunk of L tokens, value head), independent of the state: beta, the
  decay g and its running sum Γ within the chunk, the unit lower-triangular I + A with
  A[t, s] = beta_t e^(Γ_t - Γ_s) k_t . k_s (s < t), its inverse by forward substitution, and
  W = (I + A)^-1 diag(beta e^Γ) K [L, dk], U0 = (I + A)^-1 diag(beta) V [L, dv].
- `_scan_kernel`: per (value head, block of BV value columns), the chunks in order with the
  state S [dk, BV] in registers: U = U0 - W S; O = diag(e^Γ) Q S + (Q K^T ∘ e^(Γ_t - Γ_s),
  s <= t) U; S = e^Γ_L S + (K ∘ e^(Γ_L - Γ))^T U. Only this kernel is sequential over chunks.
- `_gated_norm_kernel`: per (token, value head) rms_norm(o) * w_norm * silu(z) in the
  activations' dtype, for the output projection.
q and k are L2-normalized per key head where they are read (q scaled by dk^-1/2); value head h
reads key head h // (Hv / Hk). Buffers between the kernels: mixed [T, C], W [Hv, T, dk],
U0 and O [Hv, T, dv], Γ [Hv, T], all f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting

CHUNK = 64  # tokens per chunk (L): the intra-chunk products are [L, L] tiles
CONV_BLOCK_C = 64  # channels per program of the conv
CONV_BLOCK_T = 16  # tokens per step of a conv program
SCAN_BLOCK_V = 32  # value columns of the state per scan program


@triton.jit
def _conv_kernel(x_ptr, stride_x, state_ptr, w_ptr, y_ptr, T, C,
                 K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr):  # fmt: skip
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    mc = c < C
    for t0 in range(0, T, BT):
        t = (t0 + tl.arange(0, BT)).to(tl.int64)  # t * stride past 2^31 on long prompts
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):
            p = t + (j - (K - 1))  # input position of tap j (negative: the cached inputs)
            m = (t < T)[:, None] & mc[None, :]
            xin = tl.load(x_ptr + p[:, None] * stride_x + c[None, :],
                          mask=m & (p >= 0)[:, None], other=0.0).to(tl.float32)  # fmt: skip
            old = tl.load(state_ptr + c[None, :] * (K - 1) + (p + (K - 1))[:, None],
                          mask=m & (p < 0)[:, None], other=0.0)  # fmt: skip
            acc += tl.load(w_ptr + c * K + j, mask=mc, other=0.0)[None, :] * (xin + old)
        tl.store(y_ptr + t[:, None] * C + c[None, :], acc / (1.0 + tl.exp(-acc)),
                 mask=(t < T)[:, None] & mc[None, :])  # fmt: skip
    # The new state: slot s holds input position T - (K - 1) + s (from the old state if < 0)
    s = tl.arange(0, KP)  # KP: K - 1 rounded up to a power of two
    p = (T - (K - 1) + s).to(tl.int64)
    m = mc[:, None] & (s < K - 1)[None, :]
    xin = tl.load(x_ptr + p[None, :] * stride_x + c[:, None], mask=m & (p >= 0)[None, :],
                  other=0.0).to(tl.float32)  # fmt: skip
    old = tl.load(state_ptr + c[:, None] * (K - 1) + (s + T)[None, :],
                  mask=m & (p < 0)[None, :], other=0.0)  # fmt: skip
    tl.debug_barrier()  # every read of the old state above (and in the loop) before the writes
    tl.store(state_ptr + c[:, None] * (K - 1) + s[None, :], xin + old, mask=m)


@triton.jit
def _qk_rows(mixed_ptr, t, mt, col, d, C, DK):
    """[L, BK] rows t of mixed at columns col + d, L2-normalized per row (0 where masked)."""
    x = tl.load(mixed_ptr + t[:, None] * C + col + d[None, :],
                mask=mt[:, None] & (d < DK)[None, :], other=0.0)  # fmt: skip
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _gates(proj_ptr, stride_p, t, mt, h, b_off, a_off, a_ptr, dt_ptr):
    """beta [L] and the decay g [L] (0 for both where masked) of value head h."""
    b = tl.load(proj_ptr + t * stride_p + b_off + h, mask=mt, other=0.0).to(tl.float32)
    pre = tl.load(proj_ptr + t * stride_p + a_off + h, mask=mt, other=0.0).to(tl.float32)
    pre = pre + tl.load(dt_ptr + h)
    softplus = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))
    beta = tl.where(mt, 1.0 / (1.0 + tl.exp(-b)), 0.0)
    return beta, tl.where(mt, tl.load(a_ptr + h) * softplus, 0.0)


@triton.jit
def _prep_kernel(mixed_ptr, proj_ptr, stride_p, a_ptr, dt_ptr, w_ptr, u_ptr, gam_ptr,
                 T, C, b_off, a_off, HK, HV, DK, DV,
                 L: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr,
                 PREC: tl.constexpr):  # fmt: skip
    c0 = tl.program_id(0) * L
    h = tl.program_id(1)
    kh = h // (HV // HK)
    r = tl.arange(0, L)
    t = (c0 + r).to(tl.int64)
    mt = t < T
    d = tl.arange(0, BK)
    e = tl.arange(0, BDV)
    k = _qk_rows(mixed_ptr, t, mt, HK * DK + kh * DK, d, C, DK)
    v = tl.load(mixed_ptr + t[:, None] * C + 2 * HK * DK + h * DV + e[None, :],
                mask=mt[:, None] & (e < DV)[None, :], other=0.0)  # fmt: skip
    beta, g = _gates(proj_ptr, stride_p, t, mt, h, b_off, a_off, a_ptr, dt_ptr)
    gam = tl.cumsum(g, axis=0)
    below = (r[:, None] > r[None, :]) & mt[:, None]  # s < t (t a token: no e^+big past T)
    decay = tl.exp(tl.where(below, gam[:, None] - gam[None, :], float("-inf")))
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    a = kk * decay * beta[:, None]  # strictly lower: A
    # inv = (I + A)^-1 by forward substitution: row i is final once rows < i are subtracted
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, L):
        a_col = tl.sum(tl.where(r[None, :] == i - 1, a, 0.0), axis=1)  # A[:, i - 1]
        row = tl.sum(tl.where(r[:, None] == i - 1, inv, 0.0), axis=0)  # inv[i - 1, :]
        inv -= a_col[:, None] * row[None, :]
    w = tl.dot(inv, k * (beta * tl.exp(gam))[:, None], input_precision=PREC)
    u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
    base = h * T + t
    tl.store(w_ptr + base[:, None] * DK + d[None, :], w, mask=mt[:, None] & (d < DK)[None, :])
    tl.store(u_ptr + base[:, None] * DV + e[None, :], u, mask=mt[:, None] & (e < DV)[None, :])
    tl.store(gam_ptr + base, gam, mask=mt)


@triton.jit
def _scan_kernel(mixed_ptr, state_ptr, w_ptr, u_ptr, gam_ptr, o_ptr, T, C, HK, HV, DK, DV,
                 L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 PREC: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    kh = h // (HV // HK)
    d = tl.arange(0, BK)
    e = tl.program_id(1) * BV + tl.arange(0, BV)
    md, me = d < DK, e < DV
    r = tl.arange(0, L)
    tri = r[:, None] >= r[None, :]  # s <= t
    s_offs = h * DK * DV + d[:, None] * DV + e[None, :]
    s_mask = md[:, None] & me[None, :]
    s = tl.load(state_ptr + s_offs, mask=s_mask, other=0.0)
    for c0 in range(0, T, L):
        t = (c0 + r).to(tl.int64)
        mt = t < T
        q = _qk_rows(mixed_ptr, t, mt, kh * DK, d, C, DK) / tl.sqrt(DK.to(tl.float32))
        k = _qk_rows(mixed_ptr, t, mt, HK * DK + kh * DK, d, C, DK)
        base = h * T + t
        gam = tl.load(gam_ptr + base, mask=mt, other=0.0)
        last = tl.sum(tl.where(t == tl.minimum(c0 + L, T) - 1, gam, 0.0), axis=0)  # Γ_L
        w = tl.load(w_ptr + base[:, None] * DK + d[None, :], mask=mt[:, None] & md[None, :],
                    other=0.0)  # fmt: skip
        u = tl.load(u_ptr + base[:, None] * DV + e[None, :], mask=mt[:, None] & me[None, :],
                    other=0.0)  # fmt: skip
        u = u - tl.dot(w, s, input_precision=PREC)
        decay = tl.exp(tl.where(tri & mt[:, None], gam[:, None] - gam[None, :], float("-inf")))
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        o = tl.exp(gam)[:, None] * tl.dot(q, s, input_precision=PREC)
        o += tl.dot(qk, u, input_precision=PREC)
        tl.store(o_ptr + base[:, None] * DV + e[None, :], o, mask=mt[:, None] & me[None, :])
        k_end = k * tl.where(mt, tl.exp(last - gam), 0.0)[:, None]
        s = tl.exp(last) * s + tl.dot(tl.trans(k_end), u, input_precision=PREC)
    tl.store(state_ptr + s_offs, s, mask=s_mask)


@triton.jit
def _gated_norm_kernel(o_ptr, proj_ptr, stride_p, norm_ptr, out_ptr, T, z_off, HV, DV, eps,
                       BDV: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    e = tl.arange(0, BDV)
    me = e < DV
    o = tl.load(o_ptr + (h * T + t) * DV + e, mask=me, other=0.0)
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
    z = tl.load(proj_ptr + t * stride_p + z_off + h * DV + e, mask=me, other=0.0).to(tl.float32)
    o = o * r * tl.load(norm_ptr + e, mask=me, other=0.0) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + t * HV * DV + h * DV + e, o.to(out_ptr.dtype.element_ty), mask=me)


def causal_conv(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, C] (rows may be strided: the qkv columns of the fused projection), state [C, K - 1]
    f32 (then the last K - 1 inputs, in place), w [C, K] f32 -> silu(causal conv) [T, C] f32."""
    T, (C, K) = x.shape[0], w.shape
    assert x.stride(1) == 1 and state.is_contiguous() and w.is_contiguous()
    y = torch.empty((T, C), dtype=torch.float32, device=x.device)
    _conv_kernel[(triton.cdiv(C, CONV_BLOCK_C),)](
        x, x.stride(0), state, w, y, T, C, K, triton.next_power_of_2(K - 1), CONV_BLOCK_T,
        CONV_BLOCK_C,
    )  # fmt: skip
    return y


def chunked_delta(cfg, mixed: torch.Tensor, proj: torch.Tensor, state: torch.Tensor,
                  a: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """T tokens: mixed [T, C] f32 (the conv's output), proj [T, C + Hv dv + 2 Hv] (the fused
    projection: its z, b and a columns), state [Hv, dk, dv] f32 (advanced in place), a,
    dt_bias [Hv], norm [dv] -> gated, normed output [T, Hv dv] in out_dtype."""
    hk, hv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    C, T = cfg.ssm_conv_channels, mixed.shape[0]
    z_off, b_off, a_off = C, C + hv * dv, C + hv * dv + hv
    assert proj.stride(1) == 1 and state.is_contiguous()
    dev = mixed.device
    w_buf = torch.empty((hv, T, dk), dtype=torch.float32, device=dev)
    u_buf = torch.empty((hv, T, dv), dtype=torch.float32, device=dev)
    gam = torch.empty((hv, T), dtype=torch.float32, device=dev)
    o = torch.empty((hv, T, dv), dtype=torch.float32, device=dev)
    out = torch.empty((T, hv * dv), dtype=out_dtype, device=dev)
    bk, bdv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    bv = min(SCAN_BLOCK_V, bdv)
    # Exact fp32 products when the model runs in f32 (and under the interpreter); TF32 on the
    # tensor cores for half-precision models, whose q, k, v are rounded to bf16/f16 already.
    prec = "ieee" if interpreting() or out_dtype == torch.float32 else "tf32"
    # 8 warps: a program holds several [64, 128] f32 tiles (k, q, W: 32 KiB each), which 4
    # warps could only keep by spilling. A guess to time on the device (bench/gpu_prefill.py).
    warps = 1 if interpreting() else 8
    _prep_kernel[(triton.cdiv(T, CHUNK), hv)](
        mixed, proj, proj.stride(0), a, dt_bias, w_buf, u_buf, gam, T, C, b_off, a_off,
        hk, hv, dk, dv, CHUNK, bk, bdv, prec, num_warps=warps,
    )  # fmt: skip
    # num_stages=1: the loop over chunks carries the state, and pipelining its q, k, w, u
    # loads asks for 330 KB of shared memory at head dims of 128 (an H100 has 227 KB)
    _scan_kernel[(hv, triton.cdiv(dv, bv))](
        mixed, state, w_buf, u_buf, gam, o, T, C, hk, hv, dk, dv, CHUNK, bk, bv, prec,
        num_warps=warps, num_stages=1,
    )  # fmt: skip
    _gated_norm_kernel[(T, hv)](
        o, proj, proj.stride(0), norm, out, T, z_off, hv, dv, cfg.rms_eps, bdv,
        num_warps=1 if interpreting() else 2,
    )  # fmt: skip
    return out
