"""Torch codecs of the 5-bit and K-quant block formats (ggml's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
decoders (exactly gguf-py's values) and quantizers. Plain torch, any device; blocks are uint8
[nb, block bytes] <-> float32 [nb, block elements].

Layouts (docs/gguf-layout.md):
- Q5_0: f16 d, u32 qh, uint8 qs[16] (22 bytes / 32): x[k] = d * ((qs[k] & 15 | bit k of qh << 4)
  - 16), x[k + 16] = d * ((qs[k] >> 4 | bit k + 16 of qh << 4) - 16);
- Q5_1: f16 d, f16 m, u32 qh, qs[16] (24 bytes / 32): the codes as Q5_0's, x = d * q + m;
- Q4_K: f16 d, f16 dmin, scales[12], qs[128] (144 bytes / 256): sub-block j of 32, x = d * sc_j
  * q - dmin * m_j, six-bit sc_j, m_j packed in scales, q nibble j % 2 of qs[32 (j / 2) + l];
- Q5_K: as Q4_K plus qh[32] after the scales (176 bytes): bit j of qh[l] is q's fifth bit;
- Q6_K: ql[128], qh[64], int8 scales[16], f16 d (210 bytes / 256): element 128 h + 32 p + l has
  its low 4 bits in nibble p // 2 of ql[64 h + 32 (p % 2) + l], its high 2 at bit 2 p of
  qh[32 h + l]; x = d * scales[e // 16] * (q - 32).

The K-quant quantizers follow the format's definition: per sub-block a scale (and for Q4_K /
Q5_K a min <= 0) fitted by weighted least squares over a small set of candidate grids, then the
sub-block scales (and mins) quantized to 6 bits (Q6_K: int8) against one f16 super-block scale,
and the codes recomputed from those rounded scales.
"""

from __future__ import annotations

import torch

from .expert_layouts import CODEC_BLOCKS

# Format -> (elements per block, bytes per block)
BLOCKS = CODEC_BLOCKS


# ---- decoders -----------------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of each block as f32: [nb, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """qh [nb, 4] bytes (a little-endian u32) -> bit k of it for k < 32, [nb, 32] int32."""
    bits = torch.arange(8, device=qh.device)
    return ((qh.to(torch.int32)[:, :, None] >> bits) & 1).reshape(-1, 32)


def _q5_codes(blocks: torch.Tensor, qs_at: int) -> torch.Tensor:
    """Q5_0/Q5_1 codes 0..31 [nb, 32]: nibbles of qs (low: 0..15, high: 16..31) | fifth bit."""
    qs = blocks[:, qs_at : qs_at + 16].to(torch.int32)
    nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return nibbles | (_bits32(blocks[:, qs_at - 4 : qs_at]) << 4)


def decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_q5_codes(blocks, 6) - 16).float()


def decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
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


def _k_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low 4 bits [nb, 8, 32] from qs [nb, 128]: sub-block 2k low nibbles, 2k + 1 high."""
    q = qs.to(torch.int32).reshape(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 8, 32)


def decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = k_scales_mins(blocks[:, 4:16])
    q = _k_codes(blocks[:, 16:144])
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(-1, 256)


def decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48].to(torch.int32)  # bit j of qh[l]: element l of sub-block j
    j = torch.arange(8, device=blocks.device)[:, None]
    q = _k_codes(blocks[:, 48:176]) | (((qh[:, None, :] >> j) & 1) << 4)
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(-1, 256)


def decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, 0:128].to(torch.int32).reshape(-1, 2, 1, 2, 32)  # [nb, h, nibble, p % 2, l]
    qh = blocks[:, 128:192].to(torch.int32).reshape(-1, 2, 1, 32)  # [nb, h, 1, l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # quarter p = 2 nib + p%2
    high = (qh >> (2 * torch.arange(4, device=blocks.device)[:, None])) & 3  # [nb, h, p, l]
    q = (low | (high << 4)) - 32
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 elements
    return ((_f16(blocks, 208) * sc)[..., None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


DECODERS = {"q5_0": decode_q5_0, "q5_1": decode_q5_1, "q4_k": decode_q4_k, "q5_k": decode_q5_k,
            "q6_k": decode_q6_k}  # fmt: skip


# ---- quantizers ---------------------------------------------------------------------------------


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """f32 [nb] -> its f16 bytes [nb, 2]."""
    return v.reshape(-1, 1).to(torch.float16).view(torch.uint8)


def _pack_bits32(bits: torch.Tensor) -> torch.Tensor:
    """[nb, 32] of 0/1 -> the little-endian u32 with bit k = bits[:, k], as bytes [nb, 4]."""
    weights = 1 << torch.arange(8, device=bits.device)
    return (bits.reshape(-1, 4, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _pack_q5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [nb, 32] in 0..31 -> (qh [nb, 4], qs [nb, 16])."""
    q = q.to(torch.int32)
    qs = ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).to(torch.uint8)
    return _pack_bits32(q >> 4), qs


def encode_q5_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference: d = (the value of largest |x|) / -16, q = min(31, trunc(x / d + 16.5))."""
    mx = torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))
    d = mx / -16.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(x * inv + 16.5), max=31)
    qh, qs = _pack_q5(q)
    return torch.cat([_f16_bytes(d), qh, qs], dim=1)


def encode_q5_1(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference: m = min x, d = (max - min) / 31, q = trunc((x - m) / d + 0.5)."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / 31.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc((x - lo) * inv + 0.5), 0, 31)
    qh, qs = _pack_q5(q)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), qh, qs], dim=1)


def _fit_scale_min(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, ...]:
    """Per row of x [r, n] (weights w): (scale, min) with min <= 0 minimising sum w (scale q + min
    - x)^2, q = clamp(round((x - min) / scale), 0, nmax): the grid from (min x, max x) and 20
    stretched ones, each refitted by least squares; the best kept."""
    lo = torch.clamp(x.amin(dim=1, keepdim=True), max=0.0)
    hi = x.amax(dim=1, keepdim=True)
    span = torch.clamp(hi - lo, min=1e-30)
    best_s, best_m = span / nmax, lo
    best_err = _err(x, w, best_s, best_m, nmax)
    for step in range(21):
        iscale = (nmax - 1.0 + 0.1 * step) / span
        q = torch.clamp(torch.round(iscale * (x - lo)), 0, nmax)
        sw, sq, sq2 = w.sum(1, True), (w * q).sum(1, True), (w * q * q).sum(1, True)
        sx, sxq = (w * x).sum(1, True), (w * x * q).sum(1, True)
        det = sw * sq2 - sq * sq
        ok = det > 0
        s = torch.where(ok, (sw * sxq - sx * sq) / torch.where(ok, det, 1.0), best_s)
        m = torch.where(ok, (sq2 * sx - sq * sxq) / torch.where(ok, det, 1.0), best_m)
        pos = m > 0  # a min above 0 cannot be stored: refit the scale alone with min 0
        s = torch.where(pos, sxq / torch.clamp(sq2, min=1e-30), s)
        m = torch.where(pos, torch.zeros_like(m), m)
        s = torch.clamp(s, min=0.0)
        err = _err(x, w, s, m, nmax)
        better = err < best_err
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best_err = torch.where(better, err, best_err)
    return best_s, best_m


def _err(x, w, s, m, nmax):
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.clamp(torch.round((x - m) * inv), 0, nmax)
    return (w * (s * q + m - x) ** 2).sum(1, True)


def _six_bits(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-block values [nb, 8] >= 0 -> (f32 super-block scale [nb, 1], codes [nb, 8] 0..63)."""
    top = v.amax(dim=1, keepdim=True)
    d = (top / 63.0).to(torch.float16).float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return d, torch.clamp(torch.round(v * inv), 0, 63).to(torch.int32)


def _pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Six-bit scales and mins [nb, 8] -> the 12 bytes k_scales_mins reads."""
    b0 = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b1 = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    b2 = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return torch.cat([b0, b1, b2], dim=1).to(torch.uint8)


def _encode_k_min(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: x [nb, 256] -> (d, dmin as f16 bytes [nb, 2], scales [nb, 12], codes
    [nb, 8, 32] 0..nmax) from the fitted sub-block scales and mins."""
    xs = x.reshape(-1, 32)
    w = xs.pow(2).mean(1, keepdim=True).sqrt() + xs.abs()  # favour the larger weights
    s, m = _fit_scale_min(xs, w, nmax)
    d, sc = _six_bits(s.reshape(-1, 8))
    dmin, mc = _six_bits(-m.reshape(-1, 8))
    step = (d * sc).reshape(-1, 1)
    off = (dmin * mc).reshape(-1, 1)
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    q = torch.clamp(torch.round((xs + off) * inv), 0, nmax).to(torch.int32).reshape(-1, 8, 32)
    return _f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mc), q


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [nb, 8, 32] -> qs [nb, 128]: sub-block 2k in the low nibbles of qs[32 k + l]."""
    q = q.reshape(-1, 4, 2, 32)
    return ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128).to(torch.uint8)


def encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, q = _encode_k_min(x, 15)
    return torch.cat([d, dmin, scales, _pack_nibbles(q)], dim=1)


def encode_q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, q = _encode_k_min(x, 31)
    qh = ((q >> 4) << torch.arange(8, device=x.device)[None, :, None]).sum(1).to(torch.uint8)
    return torch.cat([d, dmin, scales, qh, _pack_nibbles(q)], dim=1)


def encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    """Per 16 elements a symmetric scale (candidates around -max / 32, the best by sum x^2 err),
    as int8 against an f16 super-block scale; codes q - 32 in -32..31."""
    xs = x.reshape(-1, 16)
    mx = torch.gather(xs, 1, xs.abs().argmax(dim=1, keepdim=True))
    w = xs * xs
    best_s = mx / -32.0
    best_err = torch.full_like(mx, float("inf"))
    for step in range(-9, 10):
        s = mx / -(32.0 + 0.1 * step)
        inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
        q = torch.clamp(torch.round(xs * inv), -32, 31)
        sq2 = (w * q * q).sum(1, True)
        fit = torch.where(sq2 > 0, (w * xs * q).sum(1, True) / torch.clamp(sq2, min=1e-30), s)
        err = (w * (fit * q - xs) ** 2).sum(1, True)
        better = err < best_err
        best_s, best_err = torch.where(better, fit, best_s), torch.where(better, err, best_err)
    s = best_s.reshape(-1, 16)
    top = torch.gather(s, 1, s.abs().argmax(dim=1, keepdim=True))  # [nb, 1], signed
    d = (top / -128.0).to(torch.float16).float()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    sc = torch.clamp(torch.round(s * inv), -128, 127)  # [nb, 16]
    step = (d * sc).reshape(-1, 1)
    inv = torch.where(step != 0, 1.0 / step, torch.zeros_like(step))
    q = (torch.clamp(torch.round(xs * inv), -32, 31) + 32).to(torch.int32).reshape(-1, 2, 4, 32)
    lo, hi = q & 15, q >> 4  # [nb, h, p, l]
    ql = torch.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return torch.cat([ql.reshape(-1, 128).to(torch.uint8), qh.reshape(-1, 64).to(torch.uint8),
                      sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=1)  # fmt: skip


ENCODERS = {"q5_0": encode_q5_0, "q5_1": encode_q5_1, "q4_k": encode_q4_k, "q5_k": encode_q5_k,
            "q6_k": encode_q6_k}  # fmt: skip


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float rows [..., n] (n a multiple of the block) -> uint8 [..., row bytes] in `fmt`."""
    elems, size = BLOCKS[fmt]
    n = x.shape[-1]
    if n % elems:
        raise ValueError(f"{fmt} rows need a multiple of {elems} elements, got {n}")
    out = ENCODERS[fmt](x.float().reshape(-1, elems))
    return out.reshape(*x.shape[:-1], n // elems * size)


def decode(data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """uint8 [..., row bytes] in `fmt` -> float32 [..., n]."""
    elems, size = BLOCKS[fmt]
    return DECODERS[fmt](data.reshape(-1, size)).reshape(*data.shape[:-1], n)
