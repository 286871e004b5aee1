"""4-bit repacked expert rows (q4_0r, mxfp4r: kernels.expert_formats) for the dp4a decode kernel
(kernels.moe_q4r_pipe): rows as int32 words of 8 nibbles, expanded to int8 lanes in registers;
gate/up lanes dotted with Q8-quantized x by dp4a, down lanes turned to fp32 by one prmt and an
add each (lanes_f32: no int-to-float conversion) and summed in registers. A row is loaded as
pieces of blocks B0 .. B0 + NB, NB a power of two (kernels.moe_q4r_pipe.row_pieces).

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

from .expert_rows import Q8_BIAS, dp4a, quantize_x_lanes, x_lanes

NIBBLES = tl.constexpr(0x0F0F0F0F)


# mxfp4 -> int8 lanes, 8 weights per call: $2 the nibble word; $0 lanes of nibbles 0..3,
# $1 of nibbles 4..7. tp / tn: the table's codes 0..7 (0 1 2 3 4 6 8 12) and 8..15 (negated)
# as bytes; s: 4 selectors (code & 7); m: byte i of p (sign 0) or byte i of n (sign 1).
def _e2m1_prmt(tp0: int, tp1: int, tn0: int, tn1: int) -> str:
    """The lookup's PTX with table words tp0, tp1 (codes 0..7) and tn0, tn1 (8..15)."""
    return f"""{{
.reg .b32 tp0, tp1, tn0, tn1, s, p, n, m;
mov.b32 tp0, 0x{tp0:08X};
mov.b32 tp1, 0x{tp1:08X};
mov.b32 tn0, 0x{tn0:08X};
mov.b32 tn1, 0x{tn1:08X};
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
}}"""


_E2M1_PRMT = tl.constexpr(_e2m1_prmt(0x03020100, 0x0C080604, 0xFDFEFF00, 0xF4F8FAFC))
# the same lookup with each lane biased by 128 (128 + v: the down rows' lanes_f32 input)
_E2M1_PRMT_BIASED = tl.constexpr(_e2m1_prmt(0x83828180, 0x8C888684, 0x7D7E7F80, 0x74787A7C))


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
def q4r_words(w_ptr, row_off, n_mask, H, B0: tl.constexpr, NB: tl.constexpr, FMT: tl.constexpr,
              ALIGN4: tl.constexpr):  # fmt: skip
    """(words [BLOCK_N, NB, 4] int32, d [BLOCK_N, NB] fp32) of blocks B0 .. B0 + NB of the rows
    (a piece: NB a power of two; blocks past H / 32 load 0). ALIGN4: the rows start 4-byte
    aligned (mxfp4r always, q4_0r when H % 64 == 0), else each word is two 16-bit loads (q4_0r
    rows are 2-aligned)."""
    b = B0 + tl.arange(0, NB)
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
def e2m1_lanes(words, ASM: tl.constexpr, BIASED: tl.constexpr = False):
    """(va, vb) int32 words of int8 lanes: the doubled e2m1 values of nibbles 0..3 and 4..7
    of each word (PRMT table lookups on a GPU, ASM; else the same bytes by arithmetic);
    BIASED: each lane 128 + value."""
    if ASM:
        va, vb = tl.inline_asm_elementwise(
            _E2M1_PRMT_BIASED if BIASED else _E2M1_PRMT, "=r,=r,r", [words],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        va = tl.zeros_like(words)
        vb = tl.zeros_like(words)
        for i in tl.static_range(4):
            va |= (_e2m1_int((words >> (4 * i)) & 15) & 0xFF) << (8 * i)
            vb |= (_e2m1_int((words >> (16 + 4 * i)) & 15) & 0xFF) << (8 * i)
        if BIASED:
            va ^= Q8_BIAS
            vb ^= Q8_BIAS
    return va, vb


@triton.jit
def q4r_lanes(words, FMT: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr = False):
    """(va, vb) int32 words of 4 int8 lanes each from nibble words: q4_0r's codes 0..15
    (element 4 w + i and 16 + 4 w + i in lane i), mxfp4r's doubled e2m1 values (e2m1_lanes;
    BIASED: plus 128)."""
    if FMT == 8:
        va, vb = e2m1_lanes(words, ASM, BIASED)
    else:
        va = words & NIBBLES
        vb = (words >> 4) & NIBBLES
    return va, vb


@triton.jit
def q4r_block_dots(words, d, xa, xb, xs, xd, FMT: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, NB] fp32 per-block terms d_w[b] * d_x[b] * isum[b] of 4-bit rows (q4r_words)
    dotted with Q8-quantized x (x_words_q4, xd [NB] its scales): an integer dot per 32-block
    (2 dp4a per nibble word), as kernels.expert_rows.q8r_dot_q8x; the caller sums the blocks
    (gate and up in one reduction)."""
    va, vb = q4r_lanes(words, FMT, ASM)
    s = dp4a(va, xa[None, :, :], tl.zeros_like(words), ASM)
    s = dp4a(vb, xb[None, :, :], s, ASM)
    isum = tl.sum(s, axis=2)  # [BLOCK_N, NB] int32
    if FMT != 8:
        isum -= 8 * xs[None, :]
    return isum.to(tl.float32) * (d * xd[None, :])


# byte i of a word into the mantissa of 2^23: 0x4B0000 | byte (the s8_to_f32 trick), one prmt
_LANES_F32 = tl.constexpr("""{
.reg .b32 k;
mov.b32 k, 0x4B000000;
prmt.b32 $0, $4, k, 0x7440;
prmt.b32 $1, $4, k, 0x7441;
prmt.b32 $2, $4, k, 0x7442;
prmt.b32 $3, $4, k, 0x7443;
}""")


@triton.jit
def lanes_f32(v, FMT: tl.constexpr, ASM: tl.constexpr):
    """The 4 int8 lanes of words v (q4r_lanes) as fp32 tensors, no int-to-float conversion:
    each byte b in the mantissa of 2^23 (one prmt a lane on a GPU), less 2^23 + 8 (q4_0r's
    codes: the value c - 8) or less 2^23 + 128 (mxfp4r's lanes, biased by 128)."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _LANES_F32, "=r,=r,=r,=r,r", [v], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        f0 = (v & 0xFF) | 0x4B000000
        f1 = ((v >> 8) & 0xFF) | 0x4B000000
        f2 = ((v >> 16) & 0xFF) | 0x4B000000
        f3 = ((v >> 24) & 0xFF) | 0x4B000000
    off = 8388736.0 if FMT == 8 else 8388616.0  # 2^23 + 128, 2^23 + 8
    f0 = f0.to(tl.float32, bitcast=True) - off
    f1 = f1.to(tl.float32, bitcast=True) - off
    f2 = f2.to(tl.float32, bitcast=True) - off
    f3 = f3.to(tl.float32, bitcast=True) - off
    return f0, f1, f2, f3


@triton.jit
def _join4(f0, f1, f2, f3):
    """[..., 2 (i), 2 (j)]: element [i, j] is f_(2 j + i) (lanes in registers, no movement)."""
    return tl.join(tl.join(f0, f1), tl.join(f2, f3))


@triton.jit
def q4r_down_axpy(words, d, coef, acc, FMT: tl.constexpr, ASM: tl.constexpr):
    """acc [BLOCK_N, NB, 4, 2, 2, 2] + coef[row] * W[row, element] for down rows loaded as
    q4r_words (coef 0 on masked rows): each nibble word's 8 values through the same lanes as
    the gate/up dots (q4r_lanes, biased), as fp32 by lanes_f32, an FMA each; the rows are
    summed once per pair run (down_elements), not per tile (a reduction across warps).
    acc[n, b, w, i, j, k]: lane 2 j + i of word w's va (k 0) or vb (k 1)."""
    va, vb = q4r_lanes(words, FMT, ASM, True)
    a0, a1, a2, a3 = lanes_f32(va, FMT, ASM)
    b0, b1, b2, b3 = lanes_f32(vb, FMT, ASM)
    f = tl.join(_join4(a0, a1, a2, a3), _join4(b0, b1, b2, b3))  # [BLOCK_N, NB, 4, 2, 2, 2]
    return acc + f * (d * coef[:, None])[:, :, None, None, None, None]


@triton.jit
def down_elements(acc, FMT: tl.constexpr):
    """q4r_down_axpy's acc summed over its rows, in element order: [NB, 32] (entry
    [b, w, i, j, k]: lane 2 j + i of word w's va (k 0) or vb (k 1); q4_0r: element
    16 k + 4 w + 2 j + i of block b; mxfp4r, two bytes a 16-bit half, a byte's nibbles
    elements n and n + 16: 16 i + 4 w + 2 k + j), so that y's atomics go 4 floats a thread.
    Once per pair run: the permutation may go through shared memory."""
    acc = tl.sum(acc, axis=0)
    NB: tl.constexpr = acc.shape[0]
    if FMT == 8:
        acc = tl.permute(acc, (0, 2, 1, 4, 3))
    else:
        acc = tl.permute(acc, (0, 4, 1, 3, 2))
    return tl.reshape(acc, [NB, 32])


@triton.jit
def blocks_at(B0: tl.constexpr, NB: tl.constexpr, H):
    """(element offsets [NB, 32], mask) of blocks B0 .. B0 + NB of an H-vector."""
    b = B0 + tl.arange(0, NB)
    return b[:, None] * 32 + tl.arange(0, 32)[None, :], (b < H // 32)[:, None]


@triton.jit
def piece_x_q8(x_ptr, xq_ptr, xd_ptr, t, stride_x, H, B0: tl.constexpr, NB: tl.constexpr,
               NBX: tl.constexpr, DP4A: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Blocks B0 .. B0 + NB of token t's x as Q8 (xq [NB, 8] int32 words, xd [NB] f32): as
    kernels.expert_rows.token_x_q8, for a piece of the row (NBX: the blocks of a row of xq)."""
    if DP4A == 2:
        x_row = x_ptr + t.to(tl.int64) * stride_x + 32 * B0
        x0, x1, x2, x3 = x_lanes(x_row, H - 32 * B0, NB)
        xq, xd = quantize_x_lanes(x0, x1, x2, x3, ASM)
    else:
        b = B0 + tl.arange(0, NB)
        row = t.to(tl.int64) * NBX + b
        xq = tl.load(xq_ptr + row[:, None] * 8 + tl.arange(0, 8)[None, :])
        xd = tl.load(xd_ptr + row)
    return xq, xd
