"""Multi-head latent attention (deepseek2) on the device: the math of pyruntime.model.mla on the
device weights, in the activation dtype (float32 for an F32 GGUF).

The layer's cache storage is one plane [capacity, rank + rope] of latents and rope keys. A
decode step (one token) is the absorbed form over the whole fixed-size plane with positions past
seq_len (a device tensor) masked, so a captured CUDA graph replays at any position without a host
sync (it reads all capacity positions each step: a split-K Triton kernel over the first seq_len,
as kernels.attention does for the other families, is what would make long contexts cheap); a
prompt is the plain form (the latents expanded per head through k_b and v_b, SDPA).
The projections are device Linears (Q8_0 stays quantized: the GEMV kernel at decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyruntime.gpu.weights import DeviceMLA
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import attention_mask


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, d] f32 rotated by cos/sin [n, d] (pairs (i, i + d/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def mla_attention(
    cfg: ModelConfig,
    w: DeviceMLA,
    h: torch.Tensor,
    plane: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    seq_len: torch.Tensor | None,
    start: int,
    scale: float,
) -> torch.Tensor:
    """The attention of h [n, n_embd] (normed) -> per-head outputs [n, H v] in h's dtype; the
    tokens' latents are written into plane [capacity, rank + rope] at `positions`. seq_len
    (decode: [1], the cached length after the step) or start (prompt: its first position)."""
    n, H, nope, rank = h.shape[0], cfg.n_head, cfg.mla_nope_dim, cfg.mla_kv_rank
    dtype = h.dtype
    cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
    if w.q is not None:
        q = w.q(h, torch.float32)
    else:
        q_lat = _rms_norm(w.q_a(h, torch.float32), w.q_a_norm, cfg.rms_eps)
        q = w.q_b(q_lat.to(dtype), torch.float32)
    q = q.view(n, H, nope + cfg.rope_dim).transpose(0, 1)  # [H, n, nope + rope]
    q_nope, q_pe = q[..., :nope], _rope(q[..., nope:], cos, sin)
    kv = w.kv_a(h, torch.float32)
    latent = torch.cat(
        [_rms_norm(kv[:, :rank], w.kv_a_norm, cfg.rms_eps), _rope(kv[:, rank:], cos, sin)], dim=-1
    )
    plane.index_copy_(0, positions, latent.to(plane.dtype))
    if seq_len is not None:
        return _absorbed(cfg, w, q_nope, q_pe, plane, seq_len, scale).to(dtype)
    end = start + n
    latents = plane[:end]
    c_kv, k_pe = latents[:, :rank], latents[:, rank:]
    k_nope = torch.einsum("pr,hrd->hpd", c_kv, w.k_b)  # [H, end, nope]
    values = torch.einsum("pr,hvr->hpv", c_kv, w.v_b)  # [H, end, v]
    keys = torch.cat([k_nope, k_pe.expand(H, -1, -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).to(plane.dtype)
    mask = attention_mask(start, end, device=h.device)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(n, H * cfg.mla_v_dim).to(dtype)


def _absorbed(cfg: ModelConfig, w: DeviceMLA, q_nope, q_pe, plane, seq_len, scale):
    """One token (q_nope [H, 1, nope], q_pe [H, 1, rope] f32) against the plane's first seq_len
    positions: k_b folded into the query, v_b after the weighted sum of the latents."""
    rank = cfg.mla_kv_rank
    q_lat = torch.bmm(q_nope.to(w.k_b.dtype), w.k_b.transpose(1, 2)).float()  # [H, 1, rank]
    query = torch.cat([q_lat, q_pe], dim=-1)[:, 0]  # [H, rank + rope]
    latents = plane.float()
    scores = (query @ latents.T) * scale  # [H, capacity]
    valid = torch.arange(plane.shape[0], device=plane.device) < seq_len
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    o_lat = probs @ latents[:, :rank]  # [H, rank]
    out = torch.bmm(o_lat[:, None].to(w.v_b.dtype), w.v_b.transpose(1, 2))  # [H, 1, v]
    return out.reshape(1, cfg.n_head * cfg.mla_v_dim)
