"""Random stored blocks of the formats gguf-py cannot quantize to (the K-quants), for kernel and
dequantization tests: every byte random (all codes, every packed scale/min bit pattern) except
the f16 block scales, which are set to finite values of a chosen size."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from pyruntime.kernels.expert_formats import quantize_x_q8_ref

# Byte offsets of the f16 super-block scales: (d, dmin) or (d,)
F16_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Largest |code times sub-block scale| (before d): how big a weight is per unit of d
CODE_RANGE = {Q.Q4_K: 15 * 63, Q.Q5_K: 31 * 63, Q.Q6_K: 32 * 128}
# The K-quant formats by name (row lengths a multiple of 256)
K_QUANTS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}


def random_blocks(
    qtype: Q, rows: int, n: int, rng: np.random.Generator, scale: float
) -> np.ndarray:
    """uint8 [rows, row bytes] of random `qtype` blocks whose weights are at most ~`scale`."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n // block
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    for at in F16_SCALES[qtype]:
        # per block, a scale in [0.25, 1] of the largest (the mins' share similar), f16 bytes
        d = scale / CODE_RANGE[qtype] * rng.uniform(0.25, 1.0, (rows, nb))
        raw[:, :, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * size)


def quantize_x_q8k_ref(x: torch.Tensor) -> torch.Tensor:
    """Activations [..., n] -> d * q in float64 as the C core quantizes them for the K-quants
    (pyrt_quantize_x_q8k): quantize_x_q8_ref's rounding with d = amax / 127 shared by each whole
    group of 256; blocks of 32 after the last whole group as quantize_x_q8_ref."""
    xf = x.detach().float().cpu()
    n = xf.shape[-1]
    whole = n - n % 256
    head = xf[..., :whole].reshape(*xf.shape[:-1], -1, 256)
    d = head.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = (d.double() * torch.round(head * inv).double()).reshape(*xf.shape[:-1], whole)
    return torch.cat([q, quantize_x_q8_ref(xf[..., whole:])], dim=-1).to(x.device)


def q4_k_scales_codes(raw: np.ndarray, n: int, q5: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (q5: Q5_K) rows uint8 [rows, row bytes] -> (d sc_j per sub-block of 32: float64
    [rows, n / 32], codes q: int64 [rows, n]), the weights being (d sc_j) q - (dmin m_j) (ggml's
    layout; Q5_K: bit j of qh[l] is the fifth bit of element l of sub-block j)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, n // 256, 176 if q5 else 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    p = b[..., 4:16].astype(np.int64)
    sc = np.concatenate(
        [p[..., 0:4] & 63, (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)], axis=-1
    )
    at = 48 if q5 else 16
    qs = b[..., at : at + 128].astype(np.int64).reshape(rows, n // 256, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3)  # [rows, sb, pair, nibble, 32]: sub-block 2k + h
    q = q.reshape(rows, n // 256, 8, 32)
    if q5:
        qh = b[..., 16:48].astype(np.int64).reshape(rows, n // 256, 1, 32)
        q = q | (((qh >> np.arange(8).reshape(1, 1, 8, 1)) & 1) << 4)
    return (d[..., None] * sc).reshape(rows, n // 32), q.reshape(rows, n)


def q6_k_scales_codes(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K rows uint8 [rows, row bytes] -> (d sc_j per sub-block of 16: float64 [rows, n / 16],
    codes q in 0..63: int64 [rows, n]), the weights being (d sc_j) (q - 32) (ggml's layout:
    element 128 h + 32 p + l has its low 4 bits in nibble p / 2 of ql[64 h + 32 (p % 2) + l],
    its high 2 at bits 2 p of qh[32 h + l])."""
    rows = raw.shape[0]
    b = raw.reshape(rows, n // 256, 210)
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)
    sc = b[..., 192:208].view(np.int8).astype(np.float64)
    ql = b[..., 0:128].astype(np.int64).reshape(rows, n // 256, 2, 2, 32)  # [h, p % 2, l]
    qh = b[..., 128:192].astype(np.int64).reshape(rows, n // 256, 2, 1, 32)  # [h, -, l]
    p = np.arange(4).reshape(1, 1, 1, 4, 1)
    lo = (ql[:, :, :, p[0, 0, 0, :, 0] % 2] >> (4 * (p // 2))) & 0xF
    q = lo | (((qh >> (2 * p)) & 3) << 4)  # [rows, sb, h, p, l]
    return (d[..., None] * sc).reshape(rows, n // 16), q.reshape(rows, n)
