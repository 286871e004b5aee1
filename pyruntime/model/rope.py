"""Rotary position embedding: the frequencies (plain or YaRN-scaled) and the cos/sin tables.

HF's "rotate_half" pairing (dimension i with i + d/2). YaRN (gpt-oss) follows transformers'
_compute_yarn_parameters op for op in float32: each frequency blends its extrapolated (theta^-2i/d)
and interpolated (that / factor) value by a linear ramp over the dimensions between the correction
bounds of beta_fast and beta_slow rotations, and cos and sin are multiplied by the attention factor
(0.1 ln(factor) + 1 unless the model gives one), which scales both q and k. Llama 3 scaling
(llama4) follows transformers' _compute_llama3_parameters: frequencies of wavelength past
original_context_length / low_freq_factor are divided by factor, those under
original_context_length / high_freq_factor kept, those between blended.
"""

from __future__ import annotations

import math

import torch

from pyruntime.model.rope_scaling import Llama3, Yarn

__all__ = ["Llama3", "Yarn", "attention_factor", "inv_frequencies", "rope_tables"]


def inv_frequencies(
    dim: int, theta: float, yarn: Yarn | None = None, llama3: Llama3 | None = None
) -> torch.Tensor:
    """float32 [dim / 2]: the rotation frequency of each pair of dimensions."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if llama3 is not None:
        return _llama3_frequencies(1.0 / (theta**exponents), llama3)
    if yarn is None:
        return 1.0 / (theta**exponents)
    pos_freqs = theta**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_context_length / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _llama3_frequencies(inv_freq: torch.Tensor, s: Llama3) -> torch.Tensor:
    old = s.original_context_length
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def attention_factor(yarn: Yarn | None) -> float:
    """The factor cos and sin are multiplied by (1.0 without YaRN)."""
    if yarn is None:
        return 1.0
    if yarn.attn_factor is not None:
        return yarn.attn_factor
    return 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n, 2 * len(inv_freq)] float32 (frequencies repeated twice, rotate_half)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin
