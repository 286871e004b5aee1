"""Dequantize GGUF tensor bytes into float32 torch tensors (CPU, vectorized).

Formats (docs/gguf-layout.md): F32, F16, BF16, and 32-element blocks along each row:
- Q8_0: f16 d, int8 q[32]            -> x = d * q                    (34 bytes / block)
- Q4_0: f16 d, uint8 qs[16]          -> x[k] = d * ((qs[k] & 15) - 8),
                                         x[k+16] = d * ((qs[k] >> 4) - 8) (18 bytes / block)
- MXFP4: uint8 e (E8M0), uint8 qs[16] -> x[k] = e2m1(qs[k] & 15) * 2^(e - 127),
                                         x[k+16] = e2m1(qs[k] >> 4) * 2^(e - 127) (17 bytes)
- Q5_0: f16 d, u32 qh, uint8 qs[16]  -> x[k] = d * ((qs[k] & 15 | bit k of qh << 4) - 16),
                                         x[k+16] = d * ((qs[k] >> 4 | bit k+16 of qh << 4) - 16)
- Q5_1: f16 d, f16 m, u32 qh, qs[16] -> as Q5_0 without the -16, plus m          (24 bytes)
and 256-element super-blocks (ggml's K-quants), in sub-blocks of 32 (Q4_K, Q5_K) or 16 (Q6_K):
- Q4_K: f16 d, f16 dmin, scales[12] (8 six-bit scales and mins), qs[128]:
        sub-block j: x = d * sc_j * q - dmin * m_j, q the nibbles (144 bytes)
- Q5_K: as Q4_K plus qh[32] (the fifth bit), q in 0..31 (176 bytes)
- Q6_K: ql[128], qh[64] (the two high bits), int8 scales[16], f16 d:
        x = d * sc_j * (q - 32), q in 0..63 (210 bytes)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SUPPORTED = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.MXFP4,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
# The supported formats by the names the GPU kernels use (pyruntime.kernels.expert_formats).
FORMAT_NAMES = {
    GGMLQuantizationType.F32: "f32",
    GGMLQuantizationType.F16: "f16",
    GGMLQuantizationType.BF16: "bf16",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.MXFP4: "mxfp4",
}
MXFP4_BLOCK_BYTES = 17  # uint8 e (E8M0 scale), uint8 qs[16]
E8M0_NAN = 0xFF  # the scale code that is no power of two: a broken block
# e2m1 code -> value doubled (ggml's kvalues_mxfp4); the block scale is then 2^(e - 128)
_E2M1_X2 = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32
)


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes of one row of `n` elements."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n // block * size


def _as_torch_bytes(raw: np.ndarray) -> torch.Tensor:
    """Zero-copy uint8 torch view of a (read-only) memmap slice."""
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        # The mmap is read-only; we never write through this view.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(flat)


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Return a new float32 tensor of `shape` (row-major) from the stored bytes `raw`."""
    b = _as_torch_bytes(raw)
    n = int(np.prod(shape))
    if qtype == GGMLQuantizationType.F32:
        out = b.view(torch.float32).clone()
    elif qtype == GGMLQuantizationType.F16:
        out = b.view(torch.float16).float()
    elif qtype == GGMLQuantizationType.BF16:
        out = b.view(torch.bfloat16).float()
    elif qtype == GGMLQuantizationType.Q8_0:
        blocks = b.view(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()  # [nb, 1]
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [nb, 32]
        out = (d * q).reshape(-1)
    elif qtype == GGMLQuantizationType.Q4_0:
        blocks = b.view(-1, 18)
        d = blocks[:, :2].contiguous().view(torch.float16).float()  # [nb, 1]
        qs = blocks[:, 2:].to(torch.int16)  # [nb, 16]
        lo = (qs & 0x0F) - 8
        hi = (qs >> 4) - 8
        out = (d * torch.cat([lo, hi], dim=1).float()).reshape(-1)
    elif qtype == GGMLQuantizationType.MXFP4:
        blocks = b.view(-1, MXFP4_BLOCK_BYTES)
        e = blocks[:, :1].to(torch.int32)  # [nb, 1]
        # 2^(e - 128) from its bits, as ggml_e8m0_to_fp32_half (e < 2: subnormal)
        bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        scale = bits.view(torch.float32)
        qs = blocks[:, 1:].long()  # [nb, 16]
        values = torch.cat([_E2M1_X2[qs & 0x0F], _E2M1_X2[qs >> 4]], dim=1)
        out = (values * scale).reshape(-1)
    elif qtype in _BLOCK_DECODERS:
        out = _BLOCK_DECODERS[qtype](b.view(-1, GGML_QUANT_SIZES[qtype][1])).reshape(-1)
    else:
        raise NotImplementedError(f"dequantization of {qtype.name} is not supported")
    if out.numel() != n:
        raise ValueError(f"{qtype.name}: {out.numel()} elements stored, shape {shape} needs {n}")
    return out.reshape(shape)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of each block as f32: [nb, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: qh [nb, 4] bytes (a little-endian u32) -> bit k of it for k < 32, [nb, 32]."""
    bits = torch.arange(8, dtype=torch.int16)
    return ((qh.to(torch.int16)[:, :, None] >> bits) & 1).reshape(-1, 32)


def _q5_codes(blocks: torch.Tensor, qs_at: int) -> torch.Tensor:
    """Q5_0/Q5_1 codes 0..31 [nb, 32]: nibbles of qs (low: 0..15, high: 16..31) | fifth bit."""
    qs = blocks[:, qs_at : qs_at + 16].to(torch.int16)
    nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return nibbles | (_fifth_bits(blocks[:, qs_at - 4 : qs_at]) << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_q5_codes(blocks, 6) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _q5_codes(blocks, 8).float() + _f16(blocks, 2)


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 12 packed bytes [nb, 12] -> six-bit (scales, mins), each [nb, 8] int32
    (ggml's get_scale_min_k4: sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7; 4..7 from
    the nibbles of bytes 8..11 and the top 2 bits of bytes 0..3 / 4..7)."""
    s = scales.to(torch.int32)
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], dim=1)
    m = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], dim=1)
    return sc, m


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = k_scales_mins(blocks[:, 4:16])
    qs = blocks[:, 16:144].to(torch.int32).reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)  # sub-block 2k: low nibbles
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48].to(torch.int32)  # bit j of qh[l]: element l of sub-block j
    qs = blocks[:, 48:176].to(torch.int32).reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)
    q = q | (((qh[:, None, :] >> torch.arange(8)[:, None]) & 1) << 4)
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Per half h of 128: quarter p of 32 elements (l < 32) has the low 4 bits in nibble p // 2
    of ql[64h + 32 (p % 2) + l] and the high 2 bits at bit 2p of qh[32h + l]."""
    ql = blocks[:, 0:128].to(torch.int32).reshape(-1, 2, 1, 2, 32)  # [nb, h, nibble, p % 2, l]
    qh = blocks[:, 128:192].to(torch.int32).reshape(-1, 2, 1, 32)  # [nb, h, 1, l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # quarter p = 2 nib + p%2
    high = (qh >> (2 * torch.arange(4)[:, None])) & 3  # [nb, h, p, l]
    q = (low | (high << 4)) - 32
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 elements
    d = _f16(blocks, 208)
    return ((d * sc)[..., None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


_BLOCK_DECODERS = {
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def first_broken_mxfp4_block(raw: np.ndarray) -> int | None:
    """Index of the first MXFP4 block of `raw` (the tensor's bytes) whose scale is 0xFF, or None.
    Reads one byte in 17 (every page of the tensor, once)."""
    scales = np.asarray(raw).reshape(-1).view(np.uint8).reshape(-1, MXFP4_BLOCK_BYTES)[:, 0]
    broken = np.flatnonzero(scales == E8M0_NAN)
    return int(broken[0]) if len(broken) else None


@dataclass(frozen=True)
class QuantMatrix:
    """A weight matrix [n_out, n_in] left where the GGUF mmap puts it, in its stored format.

    Dense weights stay like this (no float32 copy in memory): the C core reads them in place
    (pyruntime.cpu.core.CpuCore.linear and the decode step); the torch path dequantizes them
    only where and when it computes with them (`dequantize`, `rows`).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # [n_out, n_in], row-major
    raw: np.ndarray  # the mmap view (typed for F32/F16, bytes per row otherwise)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> torch.Tensor:
        """A new float32 tensor [n_out, n_in]."""
        return dequantize(self.raw, self.qtype, self.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int tensor [n]) dequantized: float32 [n, n_in] (an embedding lookup)."""
        n_out, n_in = self.shape
        by_row = np.asarray(self.raw).reshape(-1).view(np.uint8).reshape(n_out, -1)
        picked = by_row[ids.reshape(-1).numpy()]  # [n, row_bytes], a copy of those rows only
        return dequantize(picked, self.qtype, (picked.shape[0], n_in))
