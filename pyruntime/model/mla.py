"""Multi-head latent attention (DeepSeek-V2; GGUF arch deepseek2): the reference math.

Per token x [n_embd]:
- query: q = Wq x, or with a query LoRA q = Wq_b rmsnorm(Wq_a x); per head h: q_nope[h]
  (nope dims) and q_pe[h] (rope dims, rotated at the token's position);
- latent: [c; k_pe] = Wkv_a x; c_kv = rmsnorm(c) (kv_lora_rank floats) and the rotated rope key
  k_pe (rope_dim floats, one for every head). The cache keeps only these: layer i's k[i] is
  [1, capacity, rank + rope_dim] = [c_kv; k_pe] per position (pyruntime.model.kv_cache);
- per head, the key is [Wk_b[h]^T c_kv; k_pe] and the value Wv_b[h] c_kv, with Wk_b[h]
  [rank, nope] (attn_k_b) and Wv_b[h] [v, rank] (attn_v_b); out = Wo [o_0; ...; o_H-1].

Two forms of the same attention:
- plain (decompressed; the prompt): every cached position's keys and values expanded per head,
  then softmax(q . k * scale) v;
- absorbed (decode): Wk_b folded into the query, q_lat[h] = Wk_b[h] q_nope[h] (rank floats),
  scores = (q_lat[h] . c_kv + q_pe[h] . k_pe) * scale over the cache as it is, the weighted sum
  of the latents o_lat[h] = sum_p a_p c_kv[p], then o[h] = Wv_b[h] o_lat[h]: per token
  O(H (rank nope + rank v)) for the folds instead of O(positions H (nope + v) rank) for the
  expansion. Both are tested equal (tests/test_deepseek2.py).
Rope pairs dims (i, i + d/2) of the rope part (the converter permuted DeepSeek's interleaved
pairs into that order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig


@dataclass
class MLAWeights:
    """One MLA layer's attention weights (docs/gguf-layout.md, deepseek2)."""

    q: QuantMatrix | None  # [H (nope + rope), n_embd]; None with a query LoRA
    q_a: QuantMatrix | None  # [q_rank, n_embd]
    q_a_norm: torch.Tensor | None  # [q_rank]
    q_b: QuantMatrix | None  # [H (nope + rope), q_rank]
    kv_a: QuantMatrix  # [rank + rope, n_embd]
    kv_a_norm: torch.Tensor  # [rank]
    k_b: QuantMatrix  # [H rank, nope]: attn_k_b [H, rank, nope], head h's rows h rank ...
    v_b: QuantMatrix  # [H v, rank]: attn_v_b [H, v, rank]


def head_rows(m: QuantMatrix, h: int, rows: int) -> QuantMatrix:
    """Rows [h rows, (h + 1) rows) of m, in place (one head's block of a per-head matrix)."""
    return QuantMatrix(
        f"{m.name}[{h}]", m.qtype, (rows, m.shape[1]), m.raw[h * rows : (h + 1) * rows]
    )


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, d] rotated by cos/sin [n, d] (pairs (i, i + d/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def mla_query(
    cfg: ModelConfig, w: MLAWeights, x: torch.Tensor, cos, sin, linear: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope [H, n, nope], rotated q_pe [H, n, rope]) of x [n, n_embd]."""
    n, H, nope = x.shape[0], cfg.n_head, cfg.mla_nope_dim
    if w.q is not None:
        q = linear(x, w.q)
    else:
        q = linear(_rms_norm(linear(x, w.q_a), w.q_a_norm, cfg.rms_eps), w.q_b)
    q = q.view(n, H, nope + cfg.rope_dim).transpose(0, 1)
    return q[..., :nope], _rope(q[..., nope:], cos, sin)


def mla_latent(
    cfg: ModelConfig, w: MLAWeights, x: torch.Tensor, cos, sin, linear: Callable
) -> torch.Tensor:
    """[c_kv; k_pe] [n, rank + rope] of x [n, n_embd]: what the cache keeps per position."""
    rank = cfg.mla_kv_rank
    kv = linear(x, w.kv_a)
    c_kv = _rms_norm(kv[:, :rank], w.kv_a_norm, cfg.rms_eps)
    return torch.cat([c_kv, _rope(kv[:, rank:], cos, sin)], dim=-1)


def attention_plain(
    cfg: ModelConfig, w: MLAWeights, q_nope, q_pe, latents, mask, scale: float
) -> torch.Tensor:
    """Decompressed: q_nope/q_pe [H, n, .], latents [end, rank + rope], mask [n, end] ->
    per-head outputs [n, H v]."""
    H, rank, nope, v = cfg.n_head, cfg.mla_kv_rank, cfg.mla_nope_dim, cfg.mla_v_dim
    c_kv, k_pe = latents[:, :rank], latents[:, rank:]
    k_b = w.k_b.dequantize().view(H, rank, nope)
    v_b = w.v_b.dequantize().view(H, v, rank)
    k_nope = torch.einsum("pr,hrd->hpd", c_kv, k_b)  # [H, end, nope]
    values = torch.einsum("pr,hvr->hpv", c_kv, v_b)  # [H, end, v]
    keys = torch.cat([k_nope, k_pe.expand(H, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(q.shape[1], H * v)


def heads_linear(linear: Callable) -> Callable:
    """A per-head matvec (x [H, n, n_in], m [H rows, n_in] -> [H, n, rows], head h through its
    block of rows) made of `linear` calls, one per head."""

    def per_head(x: torch.Tensor, m: QuantMatrix) -> torch.Tensor:
        rows = m.shape[0] // x.shape[0]
        return torch.stack([linear(x[h], head_rows(m, h, rows)) for h in range(x.shape[0])])

    return per_head


def attention_absorbed(
    cfg: ModelConfig, w: MLAWeights, q_nope, q_pe, latents, mask, scale: float, heads: Callable
) -> torch.Tensor:
    """The same attention with Wk_b folded into the query and Wv_b applied after the weighted
    sum of the latents (the cache is never expanded); same arguments and result. heads: a
    per-head matvec (heads_linear, or the C core's pyrt_linear_heads)."""
    H, v = cfg.n_head, cfg.mla_v_dim
    n = q_nope.shape[1]
    # q_lat[h] = Wk_b[h] q_nope[h]: attn_k_b's rows of head h, [rank, nope], times q_nope
    q_lat = heads(q_nope, w.k_b)  # [H, n, rank]
    q = torch.cat([q_lat, q_pe], dim=-1)  # [H, n, rank + rope]
    scores = (q @ latents.T) * scale  # [H, n, end]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    o_lat = probs @ latents[:, : cfg.mla_kv_rank]  # [H, n, rank]
    out = heads(o_lat, w.v_b)  # [H, n, v]
    return out.transpose(0, 1).reshape(n, H * v)
