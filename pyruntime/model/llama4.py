"""Llama-4's math beyond the shared decoder (pyruntime.model.reference calls these).

- NoPE layers (cfg.is_nope): no rope, attention over every earlier token, and with temperature
  tuning each query scaled by 1 + temperature_scale log(1 + floor((pos + 1) / temperature_length))
  (transformers' Llama4TextAttention, attn_temperature_tuning);
- rope layers: attention within chunks of cfg.attention_chunk tokens (reference.attention_mask),
  q and k L2-normalized per head after rope when cfg.qk_l2_norm;
- routing: top-k of the router logits with weights sigmoid(logit) (reference.route), each chosen
  expert fed x * weight and its output added as is (Llama4TextMoe: the weight multiplies the
  expert's INPUT, which the SwiGLU does not commute with).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyruntime.experts.store import ExpertStore
from pyruntime.model.config import ModelConfig


def temperature_scales(cfg: ModelConfig, start: int, n: int) -> torch.Tensor:
    """float32 [n]: the NoPE layers' query scale at positions start .. start + n - 1."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    return (
        torch.log1p(torch.floor((pos + 1.0) / cfg.temperature_length)) * (cfg.temperature_scale)
        + 1.0
    )


def input_weighted_experts(
    experts: Callable[..., tuple[torch.Tensor, int]],
    store: ExpertStore,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: str,
    threshold: float | None,
    observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, int]:
    """Routed experts whose weight multiplies their input: x [T, n_embd], ids / weights [T, K];
    per slot s, the backend `experts` (reference.ExpertFn) runs x * weights[:, s] through
    ids[:, s] with weight 1. observer(x_s, ids_s) sees each slot's input (calibration)."""
    y = torch.zeros_like(x)
    n_active = 0
    ones = torch.ones_like(weights[:, :1])
    for s in range(ids.shape[1]):
        xs, ids_s = x * weights[:, s : s + 1], ids[:, s : s + 1]
        if observer is not None:
            observer(xs, ids_s)
        out, active = experts(store, xs, ids_s, ones, act, threshold)
        y += out
        n_active += active
    return y, n_active
