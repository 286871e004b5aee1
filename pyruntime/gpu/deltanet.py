"""A Gated DeltaNet layer's prompt on the GPU: the causal conv over the prompt and the chunked
form of the recurrence (pyruntime.model.deltanet: a unit-triangular solve and a few matrix
products per chunk of 64 tokens per head, batched over heads, in torch on the device). One token
takes the decode kernels (kernels.deltanet) instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyruntime.model import deltanet as ref


def deltanet_prefill(cfg, proj: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
                     ssm_state: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                     norm: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """T tokens: proj [T, C + Hv dv + 2 Hv] -> gated, normed output [T, Hv dv] in out_dtype; the
    conv and ssm states updated in place (the chunked form of pyruntime.model.deltanet)."""
    hk, hv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    C, T = cfg.ssm_conv_channels, proj.shape[0]
    proj = proj.float()
    z, b, alpha = torch.split(proj[:, C:], [hv * dv, hv, hv], dim=-1)
    mixed, new_conv = ref.causal_conv(proj[:, :C], conv_state, conv_w)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    group = hv // hk
    q = (ref.l2norm(q.reshape(T, hk, dk)) * dk**-0.5).repeat_interleave(group, dim=1)
    k = ref.l2norm(k.reshape(T, hk, dk)).repeat_interleave(group, dim=1)
    g = a * F.softplus(alpha + dt_bias)
    o, new_ssm = ref.chunked(q, k, v.reshape(T, hv, dv), g, torch.sigmoid(b), ssm_state)
    conv_state.copy_(new_conv)
    ssm_state.copy_(new_ssm)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * norm
    return (o * F.silu(z.reshape(T, hv, dv))).reshape(T, hv * dv).to(out_dtype)
