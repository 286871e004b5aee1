"""4-bit repacked expert rows (q4_0r, mxfp4r: kernels.expert_formats) for the dp4a decode kernel
(kernels.moe_q4r_pipe): gate/up rows as int32 words of 8 nibbles, dotted with Q8-quantized x by
dp4a after their nibbles are expanded to int8 lanes in registers; down rows as raw nibble bytes,
decoded to fp32 by bit tricks (no int-to-float conversion) and summed in registers.

Nibble word w (0..3) of block b is bytes 16 b + 4 w .. 16 b + 4 w + 3 of the row; byte k of a
block holds element k (low nibble) and element k + 16 (high nibble). Expanded to two words of
four int8 lanes:
- q4_0r: va = word & 0x0F0F0F0F (element 4 w + i in lane i) and vb = (word >> 4) & 0x0F0F0F0F
  (element 16 + 4 w + i): the codes 0..15 themselves; their - 8 is folded into the block sum,
  sum (c - 8) xq = dp4a(c, xq) - 8 sum xq (x's block sums, once per token): 3 integer
  instructions and 2 dp4a per 8 weights.
- mxfp4r: each 16-bit half of the word (nibbles of elements 4w + j, 4w + 16 + j, 4w + j + 1,
  4w + j + 17; j = 0, 2) looked up in the doubled e2m1 table (E2M1_X2, -12..12) by PTX
  prmt.b32: one prmt on the table's positive half, one on its negative half (the code's low 3
  bits select), one choosing per lane by the sign bit; x's Q8 words are interleaved to match
  once per token (x_words_q4).
"""

import triton
import triton.language as tl

from .expert_rows import dp4a, e2m1_x2_bits, u4_to_f32

NIBBLES = tl.constexpr(0x0F0F0F0F)

# mxfp4 -> int8 lanes, 8 weights per call: $2 the nibble word; $0 lanes of nibbles 0..3,
# $1 of nibbles 4..7. tp / tn: the table's codes 0..7 (0 1 2 3 4 6 8 12) and 8..15 (negated)
# as bytes; s: 4 selectors (code & 7); m: byte i of p (sign 0) or byte i of n (sign 1).
_E2M1_PRMT = tl.constexpr("""{
.reg .b32 tp0, tp1, tn0, tn1, s, p, n, m;
mov.b32 tp0, 0x03020100;
mov.b32 tp1, 0x0C080604;
mov.b32 tn0, 0xFDFEFF00;
mov.b32 tn1, 0xF4F8FAFC;
and.b32 s, $2, 0x7777;
prmt.b32 p, tp0, tp1, s;
prmt.b32 n, tn0, tn1, s;
and.b32 m, $2, 0x8888;
shr.b32 m, m, 1;
or.b32 m, m, 0x3210;
prmt.b32 $0, p, n, m;
shr.b32 s, $2, 16;
and.b32 s, s, 0x7777;
prmt.b32 p, tp0, tp1, s;
prmt.b32 n, tn0, tn1, s;
shr.b32 m, $2, 17;
and.b32 m, m, 0x4444;
or.b32 m, m, 0x3210;
prmt.b32 $1, p, n, m;
}""")


@triton.jit
def q4r_scales(row, b, m, H, FMT: tl.constexpr):
    """fp32 block scales [BLOCK_N, NB] stored after each row's H / 2 nibble bytes (row byte
    pointers [BLOCK_N], block index b [NB], mask m [BLOCK_N, NB]): q4_0r's f16 d, or
    mxfp4r's E8M0 byte e as 2^(e - 128) (the doubled e2m1 values carry the other 2)."""
    if FMT == 8:
        e = tl.load(row[:, None] + H // 2 + b[None, :], mask=m, other=0).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    else:
        dp = (row + H // 2).to(tl.pointer_type(tl.float16))[:, None] + b[None, :]
        d = tl.load(dp, mask=m, other=0.0).to(tl.float32)
    return d


@triton.jit
def q4r_words(w_ptr, row_off, n_mask, H, NB: tl.constexpr, FMT: tl.constexpr,
              ALIGN4: tl.constexpr):  # fmt: skip
    """(words [BLOCK_N, NB, 4] int32, d [BLOCK_N, NB] fp32) of whole rows; NB a power of two
    >= H / 32 (padding blocks load 0). ALIGN4: the rows start 4-byte aligned (mxfp4r always,
    q4_0r when H % 64 == 0), else each word is two 16-bit loads (q4_0r rows are 2-aligned)."""
    b = tl.arange(0, NB)
    m = n_mask[:, None] & (b < H // 32)[None, :]
    m3 = m[:, :, None]
    wi = b[:, None] * 4 + tl.arange(0, 4)[None, :]  # [NB, 4] word index in the row
    row = w_ptr + row_off  # [BLOCK_N] byte pointers
    if ALIGN4:
        wp = row.to(tl.pointer_type(tl.int32))[:, None, None] + wi[None, :, :]
        words = tl.load(wp, mask=m3, other=0)
    else:
        hp = row.to(tl.pointer_type(tl.uint16))[:, None, None] + 2 * wi[None, :, :]
        lo = tl.load(hp, mask=m3, other=0).to(tl.int32)
        hi = tl.load(hp + 1, mask=m3, other=0).to(tl.int32)
        words = lo | (hi << 16)
    return words, q4r_scales(row, b, m, H, FMT)


@triton.jit
def q4r_bytes(w_ptr, row_off, n_mask, H, NB: tl.constexpr, FMT: tl.constexpr):
    """(qs [BLOCK_N, NB, 16] raw nibble bytes, d [BLOCK_N, NB] fp32) of whole rows, as
    q4r_words (loaded now, decoded later by q4r_rows_axpy)."""
    b = tl.arange(0, NB)
    m = n_mask[:, None] & (b < H // 32)[None, :]
    row = w_ptr + row_off
    qp = row[:, None, None] + (b[:, None] * 16 + tl.arange(0, 16)[None, :])[None, :, :]
    qs = tl.load(qp, mask=m[:, :, None], other=0)
    return qs, q4r_scales(row, b, m, H, FMT)


@triton.jit
def q4r_rows_axpy(qs, d, coef, acc_lo, acc_hi, FMT: tl.constexpr):
    """(acc_lo, acc_hi) [NB, 16] + sum over rows of coef[row] * W[row, 32 b + k] (lo: k < 16,
    hi: element 16 + k) of q4r_bytes rows (coef 0 on masked rows): down rows in registers."""
    q = qs.to(tl.uint32)
    if FMT == 8:
        lo = e2m1_x2_bits(q & 15)
        hi = e2m1_x2_bits(q >> 4)
    else:
        lo = u4_to_f32(q & 15)
        hi = u4_to_f32(q >> 4)
    s = (d * coef[:, None])[:, :, None]
    return acc_lo + tl.sum(lo * s, axis=0), acc_hi + tl.sum(hi * s, axis=0)


@triton.jit
def x_words_q4(xq, FMT: tl.constexpr):
    """(xa, xb [NB, 4] int32, xs [NB] int32) from x's Q8 words (token_x_q8: word w of a block
    holds elements 4 w .. 4 w + 3): the x lanes that meet lanes va, vb of nibble word w
    (e2m1_lanes / q4r_dot_q8x), and x's block sums (q4_0's - 8)."""
    NB: tl.constexpr = xq.shape[0]
    lo, hi = tl.split(tl.permute(tl.reshape(xq, [NB, 2, 4]), (0, 2, 1)))  # words 0-3, 4-7
    if FMT == 8:  # bytes (L0, H0, L1, H1) and (L2, H2, L3, H3) of lo = L, hi = H
        xa = (lo & 0xFF) | ((hi & 0xFF) << 8) | ((lo & 0xFF00) << 8) | ((hi & 0xFF00) << 16)
        xb = ((lo >> 16) & 0xFF) | ((hi >> 8) & 0xFF00) | ((lo >> 8) & 0xFF0000) | (
            hi & -16777216)  # fmt: skip
    else:
        xa, xb = lo, hi
    ones = tl.full(xq.shape, 0x01010101, tl.int32)
    xs = tl.sum(dp4a(xq, ones, tl.zeros_like(xq), False), axis=1)
    return xa, xb, xs


@triton.jit
def _e2m1_int(c):
    """Doubled e2m1 value (int32, -12..12) of 4-bit codes c."""
    m = c & 7
    mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def e2m1_lanes(words, ASM: tl.constexpr):
    """(va, vb) int32 words of int8 lanes: the doubled e2m1 values of nibbles 0..3 and 4..7
    of each word (PRMT table lookups on a GPU, ASM; else the same bytes by arithmetic)."""
    if ASM:
        va, vb = tl.inline_asm_elementwise(
            _E2M1_PRMT, "=r,=r,r", [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        va = tl.zeros_like(words)
        vb = tl.zeros_like(words)
        for i in tl.static_range(4):
            va |= (_e2m1_int((words >> (4 * i)) & 15) & 0xFF) << (8 * i)
            vb |= (_e2m1_int((words >> (16 + 4 * i)) & 15) & 0xFF) << (8 * i)
    return va, vb


@triton.jit
def q4r_dot_q8x(words, d, xa, xb, xs, xd, FMT: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N] fp32 dots of 4-bit rows (q4r_words) with Q8-quantized x (x_words_q4, xd [NB]
    its scales): an integer dot per 32-block (2 dp4a per nibble word), then
    sum_b d_w[b] * d_x[b] * isum[b] in fp32, as kernels.expert_rows.q8r_dot_q8x."""
    if FMT == 8:
        va, vb = e2m1_lanes(words, ASM)
    else:
        va = words & NIBBLES
        vb = (words >> 4) & NIBBLES
    s = dp4a(va, xa[None, :, :], tl.zeros_like(words), ASM)
    s = dp4a(vb, xb[None, :, :], s, ASM)
    isum = tl.sum(s, axis=2)  # [BLOCK_N, NB] int32
    if FMT != 8:
        isum -= 8 * xs[None, :]
    return tl.sum(isum.to(tl.float32) * (d * xd[None, :]), axis=1)


@triton.jit
def halves_add(y_row, acc_lo, acc_hi, H, NB: tl.constexpr):
    """y_row[32 b + k] += acc_lo[b, k], y_row[32 b + 16 + k] += acc_hi[b, k] (relaxed fp32
    atomics), blocks past H / 32 off."""
    b = tl.arange(0, NB)
    h = b[:, None] * 32 + tl.arange(0, 16)[None, :]
    m = (b < H // 32)[:, None]
    tl.atomic_add(y_row + h, acc_lo, mask=m, sem="relaxed")
    tl.atomic_add(y_row + h + 16, acc_hi, mask=m, sem="relaxed")


@triton.jit
def halves_load(ptr, H, NB: tl.constexpr):
    """(lo, hi) [NB, 16] f32 of an H-vector at ptr in halves_add's layout (0 past H)."""
    b = tl.arange(0, NB)
    h = b[:, None] * 32 + tl.arange(0, 16)[None, :]
    m = (b < H // 32)[:, None]
    return tl.load(ptr + h, mask=m, other=0.0), tl.load(ptr + h + 16, mask=m, other=0.0)
