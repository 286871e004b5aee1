"""Triton device helpers shared by the MoE kernels: in-kernel dequantization of expert rows.

A "row" is one gate, up or down^T row of `ffn_gud_exps` (docs/gguf-layout.md), n_embd = H
elements along the hidden dimension. `row_off` locates each row of a tile of BLOCK_N rows:
an element offset for float formats (FMT 0: f32/f16/bf16, the pointer is typed) or a byte offset
for block formats (FMT 1: Q8_0, 34-byte blocks; FMT 2: Q4_0, 18-byte blocks; FMT 6: MXFP4,
17-byte blocks, read through Q4_0's code path; FMT 3 / 4 / 8: the repacked q8_0r / q4_0r /
mxfp4r rows (kernels.expert_formats); FMT 7 / 9: Q5_0 / Q5_1 and 11 / 13 / 15: Q4_K /
Q5_K / Q6_K, read through Q8_0's code path per block of 32; uint8 pointer).
Rows are never dequantized to memory: each helper loads raw bytes and works in fp32 registers.

Two access shapes:
- GEMV (decode, sparse): rows_dot / rows_axpy use 3-D tiles [BLOCK_N, BLOCK_H // 32, 32] so the
  block scale is loaded once per block and applied after the 32-element inner sum;
- GEMM (prefill): rows_tile returns a 2-D fp32 tile [BLOCK_N, BLOCK_K] for tl.dot (its scale
  reloads hit L1 and are amortized over the BLOCK_M tokens of the tile).
"""

import triton
import triton.language as tl

from .expert_formats import SWIGLU_OAI

OAI_ALPHA = tl.constexpr(SWIGLU_OAI[0])
OAI_LIMIT = tl.constexpr(SWIGLU_OAI[1])


@triton.jit
def act_fn(g, ACT: tl.constexpr):
    """ACT 0: silu(g) = g * sigmoid(g); ACT 1: gelu, tanh approximation (gelu_pytorch_tanh);
    ACT 2: swiglu oai's gate, g' * sigmoid(alpha g') with g' = min(g, limit) (its up: up_fn).

    Written from tl.exp (no libdevice; the interpreter lacks it). Overflow of exp saturates to
    the right limits: silu(-inf side) -> -0, tanh(+-inf side) -> +-1.
    """
    if ACT == 0:
        out = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) * (...)
        th = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))  # tanh(z)
        out = 0.5 * g * (1.0 + th)
    else:
        gc = tl.minimum(g, OAI_LIMIT)
        out = gc / (1.0 + tl.exp(gc * (-OAI_ALPHA)))
    return out


@triton.jit
def up_fn(u, ACT: tl.constexpr):
    """What multiplies act(gate): u, or (ACT 2) swiglu oai's clamp(u, -limit, limit) + 1."""
    if ACT == 2:
        out = tl.minimum(tl.maximum(u, -OAI_LIMIT), OAI_LIMIT) + 1.0
    else:
        out = u
    return out


@triton.jit
def gate_up_bias(bias_ptr, ids_ptr, p, n, n_mask, F):
    """(bg, bu) [BLOCK_N] f32: the gate and up biases of neurons n of pair p's expert, from the
    biases [n_expert, F, 2] indexed by the global expert id (not the slot: the biases stay whole
    on the device when the weights are a cache of slots)."""
    e = tl.load(ids_ptr + p).to(tl.int64)
    b = bias_ptr + (e * F + n) * 2
    return tl.load(b, mask=n_mask, other=0.0), tl.load(b + 1, mask=n_mask, other=0.0)


@triton.jit
def expert_slot(ids_ptr, map_ptr, p, HAS_MAP: tl.constexpr):
    """int64 slot in the expert tensor of pair p's expert: its id, or map[id] with an expert
    map (-1: not on this device; kernels.moe_args)."""
    e = tl.load(ids_ptr + p).to(tl.int64)
    if HAS_MAP:
        e = tl.load(map_ptr + e).to(tl.int64)
    return e


@triton.jit
def s8_to_f32(q):
    """uint8 bytes holding int8 values -> their fp32 values, without I2F (a conversion unit at a
    quarter of the FMA rate, the bound of a byte-per-weight GEMV): the byte b ^ 0x80 = q + 128
    goes into the mantissa of 2^23, so the float is 2^23 + 128 + q exactly; subtract."""
    bits = (q.to(tl.uint32) ^ 0x80) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128


@triton.jit
def u4_to_f32(v):
    """uint32 values in [0, 16) (Q4_0 nibbles) -> fp32 value - 8, by the same mantissa trick."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8


@triton.jit
def f16_at(p, m):
    """The f16 at byte pointers p (any shape), as fp32 (two byte loads: K-quant super-blocks
    put their scales at offsets a typed load could not take)."""
    lo = tl.load(p, mask=m, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def q5_block(w_ptr, row_off, m, h0, NB: tl.constexpr, FMT: tl.constexpr):
    """Q5_0 (FMT 7) / Q5_1 (FMT 9) blocks of 32 as (d or 1, values) like q8_blocks: element i
    has its low 4 bits in nibble i // 16 of qs[i % 16], its fifth in bit i of the u32 qh."""
    i = tl.arange(0, 32)
    BYTES: tl.constexpr = 22 if FMT == 7 else 24
    QH: tl.constexpr = 2 if FMT == 7 else 4
    b = h0 // 32 + tl.arange(0, NB)
    blk = w_ptr + row_off[:, None] + b[None, :] * BYTES  # [BLOCK_N, NB]
    m3 = m[:, :, None]
    qs = tl.load(blk[:, :, None] + QH + 4 + (i % 16)[None, None, :], mask=m3, other=0)
    qh = tl.load(blk[:, :, None] + QH + (i // 8)[None, None, :], mask=m3, other=0)
    code = ((qs.to(tl.int32) >> (4 * (i // 16))[None, None, :]) & 15) | (
        ((qh.to(tl.int32) >> (i % 8)[None, None, :]) & 1) << 4
    )
    d = f16_at(blk, m)
    if FMT == 7:
        out_d, q = d, (code - 16).to(tl.float32)
    else:  # x = d q + m: the values themselves, scale 1
        q = d[:, :, None] * code.to(tl.float32) + f16_at(blk + 2, m)[:, :, None]
        out_d = tl.where(m, 1.0, 0.0)
    return out_d, q


@triton.jit
def k_block(w_ptr, row_off, m, h0, NB: tl.constexpr, FMT: tl.constexpr):
    """K-quant sub-blocks of 32 (Q4_K FMT 11, Q5_K 13, Q6_K 15; block b is sub-block b % 8 of
    super-block b // 8) as (scale, codes) like q8_blocks: Q6_K d and sc * (q - 32); Q4_K /
    Q5_K 1 and the values d sc_j q - dmin m_j (layouts: kernels.block_codecs)."""
    i = tl.arange(0, 32)
    BYTES: tl.constexpr = 144 if FMT == 11 else (176 if FMT == 13 else 210)
    b = h0 // 32 + tl.arange(0, NB)
    j = (b % 8)[None, :]  # [1, NB]
    sb = w_ptr + row_off[:, None] + (b // 8)[None, :] * BYTES  # [BLOCK_N, NB] super-blocks
    m3 = m[:, :, None]
    if FMT == 15:
        h, p = j // 4, j % 4
        ql = tl.load(sb[:, :, None] + (64 * h + 32 * (p % 2))[:, :, None] + i[None, None, :],
                     mask=m3, other=0).to(tl.int32)  # fmt: skip
        qh = tl.load(sb[:, :, None] + (128 + 32 * h)[:, :, None] + i[None, None, :], mask=m3,
                     other=0).to(tl.int32)  # fmt: skip
        lo = (ql >> (4 * (p // 2))[:, :, None]) & 15
        hi = (qh >> (2 * p)[:, :, None]) & 3
        sc = tl.load((sb[:, :, None] + 192 + 2 * j[:, :, None] + (i // 16)[None, None, :]), mask=m3,
                     other=0).to(tl.int8, bitcast=True).to(tl.float32)  # fmt: skip
        out_d = f16_at(sb + 208, m)
        q = sc * ((lo | (hi << 4)) - 32).to(tl.float32)
    else:
        # six-bit scale and min of sub-block j: bytes P = s[j % 4], R = s[j % 4 + 4],
        # C = s[j % 4 + 8] (j >= 4) of the 12 at byte 4
        jj = j % 4
        s_p = tl.load(sb + 4 + jj, mask=m, other=0).to(tl.int32)
        s_r = tl.load(sb + 8 + jj, mask=m, other=0).to(tl.int32)
        s_c = tl.load(sb + 12 + jj, mask=m, other=0).to(tl.int32)
        sc = tl.where(j < 4, s_p & 63, (s_c & 15) | ((s_p >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, s_r & 63, (s_c >> 4) | ((s_r >> 6) << 4)).to(tl.float32)
        QS: tl.constexpr = 16 if FMT == 11 else 48
        qs = tl.load(sb[:, :, None] + QS + (32 * (j // 2))[:, :, None] + i[None, None, :],
                     mask=m3, other=0).to(tl.int32)  # fmt: skip
        code = (qs >> (4 * (j % 2))[:, :, None]) & 15
        if FMT == 13:
            qh = tl.load(sb[:, :, None] + 16 + i[None, None, :], mask=m3, other=0).to(tl.int32)
            code = code | (((qh >> j[:, :, None]) & 1) << 4)
        step = f16_at(sb, m) * sc
        off = f16_at(sb + 2, m) * mn
        q = step[:, :, None] * code.to(tl.float32) - off[:, :, None]
        out_d = tl.where(m, 1.0, 0.0)
    return out_d, q


@triton.jit
def q8_blocks(w_ptr, row_off, m, h0, H, FMT: tl.constexpr, NB: tl.constexpr):
    """(d [BLOCK_N, NB] fp32 scales, q [BLOCK_N, NB, 32] fp32 quants) of the Q8_0 blocks
    covering elements [h0, h0 + 32 * NB) of each row; m [BLOCK_N, NB] masks (row, block).
    The 5-bit and K-quant formats (FMT 7..15) the same way, per block of 32 (q5_block,
    k_block)."""
    i = tl.arange(0, 32)
    if FMT == 7 or FMT == 9:
        d, q = q5_block(w_ptr, row_off, m, h0, NB, FMT)
    elif FMT >= 11:
        d, q = k_block(w_ptr, row_off, m, h0, NB, FMT)
    elif FMT == 1:  # GGUF: block b at byte 34 b = f16 d, int8 q[32]
        b = h0 // 32 + tl.arange(0, NB)
        blk = w_ptr + row_off[:, None] + b[None, :] * 34
        d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
        qp = (blk[:, :, None] + 2 + i[None, None, :]).to(tl.pointer_type(tl.int8))
        q = tl.load(qp, mask=m[:, :, None], other=0).to(tl.float32)
    else:  # q8_0r: quant of element h at byte h, scale of block b at byte H + 2 b
        hb = h0 + tl.arange(0, NB) * 32  # first element of each block
        row = w_ptr + row_off[:, None]
        qp = row[:, :, None] + hb[None, :, None] + i[None, None, :]
        q = s8_to_f32(tl.load(qp, mask=m[:, :, None], other=0))
        # typed f16 pointer to the row's scales, then + block index: contiguous, 16-byte
        # aligned element offsets, so the NB scales load as wide vectors too
        dp = (row + H).to(tl.pointer_type(tl.float16)) + (hb // 32)[None, :]
        d = tl.load(dp, mask=m, other=0.0).to(tl.float32)
    return d, q


@triton.jit
def e2m1_x2(code):
    """Doubled e2m1 value of 4-bit codes (int32): sign bit 3; magnitudes 0, 1, 2, 3, 4, 6, 8, 12
    = m for m < 2, else (2 + (m & 1)) << (m // 2 - 1)."""
    m = code & 7
    mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where((code & 8) != 0, -mag, mag).to(tl.float32)


@triton.jit
def e2m1_x2_bits(code):
    """e2m1_x2 of uint32 codes built as float bits (no int-to-float conversion, which runs at a
    quarter of the FMA rate): magnitude m = code & 7 is 0 or 1.0 for m < 2, else the float
    with exponent m // 2 and mantissa bit m & 1, i.e. bits (m << 22) + 1.0's; sign: bit 3."""
    m = code & 7
    mag = tl.where(m < 2, m * 0x3F800000, (m << 22) + 0x3F800000)
    return (mag | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def q4_blocks(w_ptr, row_off, m, h0, H, FMT: tl.constexpr, NB: tl.constexpr):
    """(d [BLOCK_N, NB] fp32, lo, hi [BLOCK_N, NB, 16] fp32 quants - 8 of elements 0..15 and
    16..31) of the Q4_0 blocks covering [h0, h0 + 32 * NB) of each row; m as in q8_blocks.
    MXFP4 (FMT 6) and mxfp4r (FMT 8) the same way: lo, hi their doubled e2m1 values,
    d = 2^(e - 128)."""
    k = tl.arange(0, 16)
    if FMT == 8:  # mxfp4r: block b's 16 nibble bytes at byte 16 b, its E8M0 at byte H / 2 + b
        hb = h0 + tl.arange(0, NB) * 32
        row = w_ptr + row_off[:, None]
        qp = row[:, :, None] + (hb // 2)[None, :, None] + k[None, None, :]
        qs = tl.load(qp, mask=m[:, :, None], other=0).to(tl.uint32)
        lo = e2m1_x2_bits(qs & 15)
        hi = e2m1_x2_bits(qs >> 4)
        e = tl.load(row + H // 2 + (hb // 32)[None, :], mask=m, other=0).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    elif FMT == 6:  # GGUF MXFP4: block b at byte 17 b = uint8 e (E8M0), uint8 qs[16]
        b = h0 // 32 + tl.arange(0, NB)
        blk = w_ptr + row_off[:, None] + b[None, :] * 17
        e = tl.load(blk, mask=m, other=0).to(tl.int32)
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        d = bits.to(tl.float32, bitcast=True)
        qs = tl.load(blk[:, :, None] + 1 + k[None, None, :], mask=m[:, :, None], other=0)
        qs = qs.to(tl.int32)
        lo = e2m1_x2(qs & 15)
        hi = e2m1_x2(qs >> 4)
    elif FMT == 2:  # GGUF: block b at byte 18 b = f16 d, uint8 qs[16]
        b = h0 // 32 + tl.arange(0, NB)
        blk = w_ptr + row_off[:, None] + b[None, :] * 18
        d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
        qs = tl.load(blk[:, :, None] + 2 + k[None, None, :], mask=m[:, :, None], other=0)
        lo = (qs & 15).to(tl.float32) - 8.0
        hi = (qs >> 4).to(tl.float32) - 8.0
    else:  # q4_0r: block b's 16 bytes at byte 16 b, its scale at byte H / 2 + 2 b
        hb = h0 + tl.arange(0, NB) * 32
        row = w_ptr + row_off[:, None]
        qp = row[:, :, None] + (hb // 2)[None, :, None] + k[None, None, :]
        qs = tl.load(qp, mask=m[:, :, None], other=0x88).to(tl.uint32)
        lo = u4_to_f32(qs & 15)
        hi = u4_to_f32(qs >> 4)
        dp = (row + H // 2).to(tl.pointer_type(tl.float16)) + (hb // 32)[None, :]
        d = tl.load(dp, mask=m, other=0.0).to(tl.float32)
    return d, lo, hi


@triton.jit
def rows_dot(w_ptr, row_off, n_mask, x_ptr, h0, H, FMT: tl.constexpr, BLOCK_H: tl.constexpr):
    """[BLOCK_N] fp32: sum over h in [h0, h0 + BLOCK_H) of W[row, h] * x[h], masked rows -> 0.

    x_ptr points at one token's hidden vector (H elements, f32 or bf16). For block formats h0
    and BLOCK_H are multiples of 32 and H is a multiple of 32.
    """
    if FMT == 0:
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        xv = tl.load(x_ptr + h, mask=hm, other=0.0).to(tl.float32)
        m = n_mask[:, None] & hm[None, :]
        wv = tl.load(w_ptr + row_off[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
        out = tl.sum(wv * xv[None, :], axis=1)
    elif FMT % 2 == 1:
        NB: tl.constexpr = BLOCK_H // 32
        b = h0 // 32 + tl.arange(0, NB)  # block index along the row
        bm = b < H // 32
        i = tl.arange(0, 32)
        xv = tl.load(x_ptr + b[:, None] * 32 + i[None, :], mask=bm[:, None], other=0.0)
        d, q = q8_blocks(w_ptr, row_off, n_mask[:, None] & bm[None, :], h0, H, FMT, NB)
        out = tl.sum(tl.sum(q * xv.to(tl.float32)[None, :, :], axis=2) * d, axis=1)
    else:
        NB: tl.constexpr = BLOCK_H // 32
        b = h0 // 32 + tl.arange(0, NB)
        bm = b < H // 32
        k = tl.arange(0, 16)
        xo = b[:, None] * 32 + k[None, :]
        x_lo = tl.load(x_ptr + xo, mask=bm[:, None], other=0.0).to(tl.float32)  # elements 0..15
        x_hi = tl.load(x_ptr + xo + 16, mask=bm[:, None], other=0.0).to(tl.float32)  # 16..31
        d, lo, hi = q4_blocks(w_ptr, row_off, n_mask[:, None] & bm[None, :], h0, H, FMT, NB)
        s = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)
        out = tl.sum(s * d, axis=1)
    return out


@triton.jit
def dot_acc_zeros(BLOCK_N: tl.constexpr, FMT: tl.constexpr, BLOCK_H: tl.constexpr):
    """Elementwise accumulator of rows_dot_acc: [BLOCK_N, BLOCK_H] (float formats),
    [BLOCK_N, BLOCK_H // 32, 32] (Q8_0 family) or [BLOCK_N, BLOCK_H // 32, 16] (Q4_0)."""
    if FMT == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    elif FMT % 2 == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_H // 32, 32], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_H // 32, 16], dtype=tl.float32)
    return acc


@triton.jit
def dot_acc_sum(acc, FMT: tl.constexpr):
    """[BLOCK_N] row sums of a rows_dot_acc accumulator."""
    if FMT == 0:
        out = tl.sum(acc, axis=1)
    else:
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
    return out


@triton.jit
def rows_dot_acc(
    acc, w_ptr, row_off, n_mask, x_ptr, h0, H, FMT: tl.constexpr, BLOCK_H: tl.constexpr
):
    """acc + W[row, chunk] * x[chunk] elementwise (scales applied): rows_dot without the
    per-chunk cross-thread reduction, so a loop over chunks is only loads and FMAs; reduce
    once at the end with dot_acc_sum."""
    if FMT == 0:
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        xv = tl.load(x_ptr + h, mask=hm, other=0.0).to(tl.float32)
        m = n_mask[:, None] & hm[None, :]
        wv = tl.load(w_ptr + row_off[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    elif FMT % 2 == 1:
        NB: tl.constexpr = BLOCK_H // 32
        b = h0 // 32 + tl.arange(0, NB)
        bm = b < H // 32
        i = tl.arange(0, 32)
        xv = tl.load(x_ptr + b[:, None] * 32 + i[None, :], mask=bm[:, None], other=0.0)
        d, q = q8_blocks(w_ptr, row_off, n_mask[:, None] & bm[None, :], h0, H, FMT, NB)
        acc += q * d[:, :, None] * xv.to(tl.float32)[None, :, :]
    else:
        NB: tl.constexpr = BLOCK_H // 32
        b = h0 // 32 + tl.arange(0, NB)
        bm = b < H // 32
        k = tl.arange(0, 16)
        xo = b[:, None] * 32 + k[None, :]
        x_lo = tl.load(x_ptr + xo, mask=bm[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + xo + 16, mask=bm[:, None], other=0.0).to(tl.float32)
        d, lo, hi = q4_blocks(w_ptr, row_off, n_mask[:, None] & bm[None, :], h0, H, FMT, NB)
        acc += (lo * x_lo[None, :, :] + hi * x_hi[None, :, :]) * d[:, :, None]
    return acc


@triton.jit
def rows_axpy(w_ptr, row_off, n_mask, coef, y_ptr, h0, H, FMT: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[h] += sum over rows of coef[row] * W[row, h] for h in [h0, h0 + BLOCK_H), atomically.

    y_ptr points at one token's fp32 output row. coef [BLOCK_N] fp32 must be 0 on masked rows.
    Relaxed atomics: many programs (neuron tiles, experts) add into the same token row.
    """
    if FMT == 0:
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        m = n_mask[:, None] & hm[None, :]
        wv = tl.load(w_ptr + row_off[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
        c = tl.sum(wv * coef[:, None], axis=0)
        tl.atomic_add(y_ptr + h, c, mask=hm, sem="relaxed")
    elif FMT % 2 == 1:
        NB: tl.constexpr = BLOCK_H // 32
        b = h0 // 32 + tl.arange(0, NB)
        bm = b < H // 32
        i = tl.arange(0, 32)
        d, q = q8_blocks(w_ptr, row_off, n_mask[:, None] & bm[None, :], h0, H, FMT, NB)
        c = tl.sum(q * (d * coef[:, None])[:, :, None], axis=0)  # [NB, 32]
        tl.atomic_add(y_ptr + b[:, None] * 32 + i[None, :], c, mask=bm[:, None], sem="relaxed")
    else:
        NB: tl.constexpr = BLOCK_H // 32
        b = h0 // 32 + tl.arange(0, NB)
        bm = b < H // 32
        k = tl.arange(0, 16)
        d, lo, hi = q4_blocks(w_ptr, row_off, n_mask[:, None] & bm[None, :], h0, H, FMT, NB)
        sc = (d * coef[:, None])[:, :, None]
        c_lo = tl.sum(lo * sc, axis=0)  # [NB, 16]
        c_hi = tl.sum(hi * sc, axis=0)
        yo = y_ptr + b[:, None] * 32 + k[None, :]
        tl.atomic_add(yo, c_lo, mask=bm[:, None], sem="relaxed")
        tl.atomic_add(yo + 16, c_hi, mask=bm[:, None], sem="relaxed")


@triton.jit
def rows_tile(w_ptr, row_off, n_mask, h0, H, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] fp32 tile W[row, h0:h0 + BLOCK_K] (0 outside), for tl.dot.

    Block formats load [BLOCK_N, BLOCK_K // 32, 32] (one scale per block, contiguous quants)
    and reshape; h0 must be a multiple of 32 there.
    """
    if FMT == 0:
        h = h0 + tl.arange(0, BLOCK_K)
        m = n_mask[:, None] & (h < H)[None, :]
        out = tl.load(w_ptr + row_off[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
    elif FMT % 2 == 1:
        NB: tl.constexpr = BLOCK_K // 32
        b = h0 // 32 + tl.arange(0, NB)
        m = n_mask[:, None] & (b < H // 32)[None, :]
        d, q = q8_blocks(w_ptr, row_off, m, h0, H, FMT, NB)
        out = tl.reshape(q * d[:, :, None], [row_off.shape[0], BLOCK_K])
    else:
        NB: tl.constexpr = BLOCK_K // 32
        b = h0 // 32 + tl.arange(0, NB)
        m = n_mask[:, None] & (b < H // 32)[None, :]
        d, lo, hi = q4_blocks(w_ptr, row_off, m, h0, H, FMT, NB)
        lo = lo * d[:, :, None]  # elements 0..15 of each block
        hi = hi * d[:, :, None]  # elements 16..31
        both = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [BLOCK_N, NB, 2, 16]
        out = tl.reshape(both, [row_off.shape[0], BLOCK_K])
    return out


# ----------------------------------------------------------------------------------------------
# q8_0r rows as int32 words (decode GEMV of the repacked Q8_0 format)
#
# A q8_0r row's quants are contiguous bytes, so they load as int32 words: word w of block b
# holds elements 32 b + 4 w + i in byte i (i = 0..3, "lane" i). Per element the fp32 path then
# costs one byte extraction (bit-field op) + one FADD + one FFMA, with a single xor per word;
# the dp4a path multiplies 4 int8 quants by 4 int8 quantized x values in one instruction.

Q8_BIAS = tl.constexpr(-2139062144)  # 0x80808080 as int32: + 128 (mod 256) on each byte


@triton.jit
def _q8r_scales(row, b, m, H):
    """The f16 block scales stored after each q8_0r row's H quants, as fp32 [BLOCK_N, NB]
    (row byte pointers [BLOCK_N], block index b [NB], mask m [BLOCK_N, NB])."""
    dp = (row + H).to(tl.pointer_type(tl.float16))[:, None] + b[None, :]
    return tl.load(dp, mask=m, other=0.0).to(tl.float32)


@triton.jit
def q8r_words(w_ptr, row_off, n_mask, H, NB: tl.constexpr):
    """(words [BLOCK_N, NB, 8] int32, d [BLOCK_N, NB] fp32 scales) of whole q8_0r rows.

    NB: a power of two >= H / 32 (padding blocks load 0). The rows must start 4-byte aligned
    (row bytes = 34 H / 32, so H % 64 == 0); with H % 256 == 0 they are 16-byte aligned and
    each thread's 4 consecutive words load as one 16-byte vector.
    """
    b = tl.arange(0, NB)
    m = n_mask[:, None] & (b < H // 32)[None, :]
    wi = b[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NB, 8] word index in the row
    row = w_ptr + row_off  # [BLOCK_N] byte pointers
    wp = row.to(tl.pointer_type(tl.int32))[:, None, None] + wi[None, :, :]
    words = tl.load(wp, mask=m[:, :, None], other=0)
    return words, _q8r_scales(row, b, m, H)


@triton.jit
def q8_lane(biased, LANE: tl.constexpr):
    """fp32 int8 value of byte LANE of each word of `biased` (= words ^ Q8_BIAS): the byte is
    q + 128, placed in the mantissa of 2^23 and the exact float 2^23 + 128 + q less 2^23 + 128
    (the s8_to_f32 trick: no I2F; per element a PRMT, a LOP3 and an FADD)."""
    bits = ((biased >> (8 * LANE)) & 0xFF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def x_lanes(x_row, H, NB: tl.constexpr):
    """x split by word lane: (x0, x1, x2, x3) [NB, 8] fp32, x_i[b, w] = x[32 b + 4 w + i]."""
    b = tl.arange(0, NB)
    h = b[:, None] * 32 + tl.arange(0, 8)[None, :] * 4
    m = (b < H // 32)[:, None]
    x0 = tl.load(x_row + h, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_row + h + 1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + h + 2, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(x_row + h + 3, mask=m, other=0.0).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def q8r_dot(words, d, x0, x1, x2, x3):
    """[BLOCK_N] fp32 dots of q8_0r rows (q8r_words) with x (x_lanes): one FFMA chain over the
    4 lanes per word, then per-block sums times the block scale."""
    bw = words ^ Q8_BIAS
    acc = q8_lane(bw, 0) * x0[None, :, :]
    acc = q8_lane(bw, 1) * x1[None, :, :] + acc
    acc = q8_lane(bw, 2) * x2[None, :, :] + acc
    acc = q8_lane(bw, 3) * x3[None, :, :] + acc
    return tl.sum(tl.sum(acc, axis=2) * d, axis=1)


@triton.jit
def q8r_bytes(w_ptr, row_off, n_mask, H, NB: tl.constexpr):
    """(q [BLOCK_N, NB, 32] raw uint8 quants, d [BLOCK_N, NB] fp32 scales) of whole q8_0r rows
    (as q8r_words; loaded now, converted later by q8r_rows_axpy)."""
    b = tl.arange(0, NB)
    m = n_mask[:, None] & (b < H // 32)[None, :]
    row = w_ptr + row_off
    qp = row[:, None, None] + (b[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]
    q = tl.load(qp, mask=m[:, :, None], other=0)
    return q, _q8r_scales(row, b, m, H)


@triton.jit
def q8r_rows_axpy(q, d, coef, acc):
    """acc [NB, 32] + sum over rows of coef[row] * W[row, 32 b + i] (q8r_bytes rows; coef 0 on
    masked rows): down rows summed in registers, added to y once by the caller."""
    return acc + tl.sum(s8_to_f32(q) * (d * coef[:, None])[:, :, None], axis=0)


@triton.jit
def blocks_add(y_row, acc, H, NB: tl.constexpr):
    """y_row[32 b + i] += acc[b, i] (relaxed fp32 atomics, contiguous), blocks past H / 32 off."""
    b = tl.arange(0, NB)
    h = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    m = (b < H // 32)[:, None]
    tl.atomic_add(y_row + h, acc, mask=m, sem="relaxed")


@triton.jit
def _round_byte(v, ASM: tl.constexpr):
    """int32 whose low byte is round-half-even(v) (two's complement), for |v| <= 127.5.

    On a GPU (ASM) one cvt.rni: the product v = x * (1 / d) is rounded to fp32 first, as the C
    core and the torch reference do. The interpreter adds 1.5 * 2^23 (rounding v into the low
    mantissa bits); compiled for a GPU that add would be fused with the product into one FMA,
    which rounds the exact product instead and flips near-tie quants by one step (seen on the
    H100: x 1.6e-2 off the reference at n_embd 2048, gate dots 3e-4 to 1e-3 off)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "cvt.rni.s32.f32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        out = (v + 12582912.0).to(tl.int32, bitcast=True)
    return out & 0xFF


@triton.jit
def quantize_x_lanes(x0, x1, x2, x3, ASM: tl.constexpr):
    """x (x_lanes) -> Q8 blocks as the C core quantizes activations (pyrt_quantize_x_q8):
    d = amax / 127, q = round-half-even(x / d) in [-127, 127]. Returns (xq [NB, 8] int32 words,
    lane i in byte i, as q8r_words; xd [NB] fp32). ASM: on a GPU (see _round_byte)."""
    ax = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    amax = tl.max(ax, axis=1)  # [NB]
    xd = tl.div_rn(amax, 127.0)
    inv = tl.where(xd != 0.0, tl.div_rn(tl.full(xd.shape, 1.0, tl.float32), xd), 0.0)
    iv = inv[:, None]
    q0 = _round_byte(x0 * iv, ASM)
    q1 = _round_byte(x1 * iv, ASM)
    q2 = _round_byte(x2 * iv, ASM)
    q3 = _round_byte(x3 * iv, ASM)
    return q0 | (q1 << 8) | (q2 << 16) | (q3 << 24), xd


@triton.jit
def token_x_q8(x_ptr, xq_ptr, xd_ptr, t, stride_x, H, NB: tl.constexpr, DP4A: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
    """Token t's x as Q8 blocks (xq [NB, 8] int32 words, xd [NB] f32 scales): quantized here from
    x's row (DP4A 2, quantize_x_lanes) or loaded as kernels.moe_dense.quantize_x_q8 wrote them
    (DP4A 1: xq [T, NB, 8], xd [T, NB])."""
    if DP4A == 2:
        x0, x1, x2, x3 = x_lanes(x_ptr + t.to(tl.int64) * stride_x, H, NB)
        xq, xd = quantize_x_lanes(x0, x1, x2, x3, ASM)
    else:
        b = tl.arange(0, NB)
        xq = tl.load(xq_ptr + (t.to(tl.int64) * NB + b)[:, None] * 8 + tl.arange(0, 8)[None, :])
        xd = tl.load(xd_ptr + t.to(tl.int64) * NB + b)
    return xq, xd


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum over the 4 bytes of int8 a_i * int8 b_i (int32): the dp4a instruction on a GPU
    (ASM), else the same integer arithmetic (the interpreter runs no inline assembly)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        out = c
        for i in tl.static_range(4):
            out += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    return out


@triton.jit
def q8r_dot_q8x(words, d, xq, xd, ASM: tl.constexpr):
    """[BLOCK_N] fp32 dots of q8_0r rows with Q8-quantized x (quantize_x_lanes): integer dot per
    32-block (dp4a), then sum_b d_w[b] * d_x[b] * isum[b] in fp32, as the C core does."""
    s = dp4a(words, xq[None, :, :], tl.zeros_like(words), ASM)
    isum = tl.sum(s, axis=2)  # [BLOCK_N, NB] int32 (|sum| <= 32 * 127 * 127)
    return tl.sum(isum.to(tl.float32) * (d * xd[None, :]), axis=1)
