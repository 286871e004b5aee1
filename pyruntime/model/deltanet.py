"""Gated DeltaNet (qwen35moe's linear attention) in plain torch: the reference of its kernels.

A layer, for x [T, n_embd] (transformers' Qwen3_5MoeGatedDeltaNet):
    qkv = x W_qkv^T [T, C] -> causal depthwise conv (kernel K over time, per channel) -> silu
    q, k [T, Hk, dk], v [T, Hv, dv] = split(qkv); q, k L2-normalized per head, q *= dk^-1/2;
    each key head serves Hv / Hk consecutive value heads
    beta = sigmoid(x W_beta^T), g = A softplus(x W_alpha^T + dt_bias) [T, Hv] (A < 0: a decay)
    per value head, with state S [dk, dv] (zero at the sequence start), for t = 1..T:
        S = exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = S^T q_t
    out = (RMSNorm(o_t) * w_norm * silu(z_t)) W_out^T, z = x W_gate^T (per value head)
A sequence's state between forward passes: the conv's last K - 1 inputs [C, K - 1] and S per
value head [Hv, dk, dv] (pyruntime.model.recurrent_state).

Two forms of the recurrence: `recurrent` (token by token: the decode step) and `chunked` (the
prefill: per chunk of L tokens a unit lower-triangular solve and a few matrix products, the state
carried across chunks), equal up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyruntime.gguf.quant import QuantMatrix

CHUNK = 64  # tokens per chunk of the chunked form
L2_EPS = 1e-6  # transformers' l2norm (the FLA library's)


@dataclass
class DeltaNetWeights:
    """One Gated DeltaNet layer (shapes: C conv channels, Hv value heads of dv)."""

    qkv: QuantMatrix  # [C, n_embd]: queries, keys, values
    gate: QuantMatrix  # [Hv * dv, n_embd]: z, the output gate
    beta: QuantMatrix  # [Hv, n_embd]
    alpha: QuantMatrix  # [Hv, n_embd]
    conv: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv]
    a: torch.Tensor  # [Hv]: A = -exp(A_log)
    norm: torch.Tensor  # [dv]
    out: QuantMatrix  # [n_embd, Hv * dv]


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal conv) of x [T, C] after the K - 1 inputs in state [C, K - 1];
    w [C, K] (tap K - 1 multiplies the newest input). -> (y [T, C], new state [C, K - 1])."""
    k = w.shape[1]
    full = torch.cat([state.T, x], dim=0)  # [K - 1 + T, C]
    windows = full.unfold(0, k, 1)  # [T, C, K]: window t holds inputs t .. t + K - 1
    y = F.silu((windows * w).sum(-1))
    return y, full[full.shape[0] - (k - 1) :].T.contiguous()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [T, H, dk] (normalized, q scaled, one per value head), v [T, H, dv],
    g, beta [T, H], state [H, dk, dv] -> (o [T, H, dv], new state)."""
    s = state.clone()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t], s)
        u = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `recurrent`, chunk by chunk. Within a chunk of L tokens (per head, Γ_t the sum
    of g over the chunk up to t, S0 the state before it), the corrections u solve
        (I + A) U = diag(beta) (V - diag(exp Γ) K S0),
        A[t, s] = beta_t exp(Γ_t - Γ_s) k_t . k_s  (s < t),
    then O = diag(exp Γ) Q S0 + (Q K^T ∘ exp(Γ_t - Γ_s), s <= t) U and the state after it is
    exp(Γ_L) S0 + (K ∘ exp(Γ_L - Γ))^T U."""
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, T, d]
    gh, bh = g.T, beta.T  # [H, T]
    s = state.clone()
    outs = []
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc, bc = qh[:, sl], kh[:, sl], vh[:, sl], bh[:, sl]
        gam = gh[:, sl].cumsum(-1)  # [H, L]
        n = gam.shape[1]
        diff = gam[:, :, None] - gam[:, None, :]  # [H, L, L]: Γ_t - Γ_s
        incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(incl, diff, float("-inf")).exp()  # 0 above the diagonal
        a = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]
        a = a.tril(-1) + torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc[:, :, None] * (vc - gam.exp()[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        o = gam.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u
        outs.append(o)
        last = gam[:, -1:]  # [H, 1]
        s = last.exp()[:, :, None] * s + (kc * (last - gam).exp()[:, :, None]).transpose(1, 2) @ u
    return torch.cat(outs, dim=1).transpose(0, 1), s


def deltanet_layer(
    cfg,
    w: DeltaNetWeights,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    linear,
    use_chunked: bool | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet layer for x [T, n_embd] (normed), cfg a ModelConfig; updates
    conv_state [C, K - 1] and ssm_state [Hv, dk, dv] in place; linear(x, matrix) as the
    reference's. use_chunked: the chunked form (default: when T > 1) or the recurrent one."""
    T = x.shape[0]
    hk, hv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads
    dk, dv = cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    mixed, new_conv = causal_conv(linear(x, w.qkv), conv_state, w.conv)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    group = hv // hk
    q = (l2norm(q.reshape(T, hk, dk)) * dk**-0.5).repeat_interleave(group, dim=1)
    k = l2norm(k.reshape(T, hk, dk)).repeat_interleave(group, dim=1)
    v = v.reshape(T, hv, dv)
    beta = torch.sigmoid(linear(x, w.beta))
    g = w.a * F.softplus(linear(x, w.alpha) + w.dt_bias)
    form = chunked if (T > 1 if use_chunked is None else use_chunked) else recurrent
    o, new_ssm = form(q, k, v, g, beta, ssm_state)
    conv_state.copy_(new_conv)
    ssm_state.copy_(new_ssm)
    return gated_output(cfg, w, x, o, linear)


def gated_output(cfg, w: DeltaNetWeights, x: torch.Tensor, o: torch.Tensor, linear):
    """(RMSNorm(o) * w_norm * silu(z)) W_out^T for o [T, Hv, dv]."""
    T = x.shape[0]
    z = linear(x, w.gate).reshape(o.shape)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * w.norm
    return linear((normed * F.silu(z)).reshape(T, -1), w.out)
