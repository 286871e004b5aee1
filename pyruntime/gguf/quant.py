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

from pyruntime.kernels.block_codecs import DECODERS

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
    GGMLQuantizationType.Q5_0: "q5_0",
    GGMLQuantizationType.Q5_1: "q5_1",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q5_K: "q5_k",
    GGMLQuantizationType.Q6_K: "q6_k",
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


# The 5-bit and K-quant formats: torch decoders shared with the GPU path (pyruntime.kernels)
_BLOCK_DECODERS = {
    GGMLQuantizationType.Q5_0: DECODERS["q5_0"],
    GGMLQuantizationType.Q5_1: DECODERS["q5_1"],
    GGMLQuantizationType.Q4_K: DECODERS["q4_k"],
    GGMLQuantizationType.Q5_K: DECODERS["q5_k"],
    GGMLQuantizationType.Q6_K: DECODERS["q6_k"],
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
