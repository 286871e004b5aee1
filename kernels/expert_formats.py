"""Weight formats of the routed-expert tensor `ffn_gud_exps` and their torch codecs.

The tensor is `[n_expert, n_ff, 3, n_embd]` row-major (docs/gguf-layout.md): for expert e and
neuron j the rows (gate, up, down^T) are adjacent, each quantized along n_embd. The kernels take
it as a torch tensor:
- float formats (f32, f16, bf16): that dtype, shape `[n_expert, n_ff, 3, n_embd]`;
- block formats (q8_0, q4_0, mxfp4, q5_0, q5_1, q4_k, q5_k, q6_k): uint8, shape
  `[n_expert, n_ff, 3, row_bytes]` (the GGUF bytes, read as they are; mxfp4: 17-byte blocks of an
  E8M0 scale byte and 16 bytes of e2m1 nibbles; the 5-bit and K-quant layouts in
  kernels.block_codecs);
- repacked block formats (q8_0r, q4_0r, mxfp4r): the same bytes per row, regrouped once on the
  GPU by `repack_rows` (kernels.dispatch.prepare_experts) so the kernels load them with wide
  aligned loads: per row [all quants of the row][all scales of the row]:
      q8_0r:  [n_embd int8 quants][n_embd / 32 f16 scales]             (34 bytes per 32 elements)
      q4_0r:  [n_embd / 2 bytes of nibbles][n_embd / 32 f16 scales]    (18 bytes per 32 elements)
      mxfp4r: [n_embd / 2 bytes of e2m1 nibbles][n_embd / 32 E8M0 bytes][0-15 zero bytes]
              (17 bytes per 32 elements, the row padded to a multiple of 16 bytes: ROW_ALIGN)
  (q4_0r and mxfp4r keep the GGUF nibble order inside each 16-byte group: low nibble of byte
  k = element k, high nibble = element k + 16). GGUF's 34-, 18- and 17-byte blocks leave quants
  2- or 1-byte aligned, so a GPU reads them with byte loads and becomes instruction bound; here
  a row of 2048 elements (2176 or 1152 bytes) starts 16-byte aligned and its quants are
  contiguous. mxfp4r pads its rows because gpt-oss's n_embd = 2880 makes 1530-byte rows, which
  would leave most rows 2-byte aligned (1536 bytes: 0.4% more).

The codecs here are plain torch (no gguf import) so the GPU benchmark can quantize on a machine
without the gguf package; tests check them against gguf.quants, the reference codecs.
"""

from __future__ import annotations

import torch

from . import block_codecs
from .expert_layouts import (  # noqa: F401  (their home; imported from here by the kernels)
    BLOCKS,
    E2M1_X2,
    FMT_CODES,
    REPACKED,
    ROW_ALIGN,
    SCALE_BYTES,
    format_family,
    q4r_supported,
    q8r_supported,
    row_bytes,
)

FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def check_expert_tensor(w: torch.Tensor, fmt: str, n_embd: int) -> tuple[int, int]:
    """Validate the expert tensor against `fmt` and `n_embd`; return (n_expert, n_ff)."""
    if fmt not in FMT_CODES:
        raise ValueError(
            f"unknown expert weight format {fmt!r}; expected one of {sorted(FMT_CODES)}"
        )
    want_dtype = FLOAT_DTYPES.get(fmt, torch.uint8)
    last = n_embd if fmt in FLOAT_DTYPES else row_bytes(fmt, n_embd)
    if w.dtype != want_dtype or w.dim() != 4 or w.shape[2] != 3 or w.shape[3] != last:
        raise ValueError(
            f"expert tensor for {fmt} must be {want_dtype} [n_expert, n_ff, 3, {last}], "
            f"got {w.dtype} {list(w.shape)}"
        )
    if not w.is_contiguous():
        raise ValueError("expert tensor must be contiguous (the kernels index raw rows)")
    return w.shape[0], w.shape[1]


# ----------------------------------------------------------------------------------------------
# torch codecs (ggml reference semantics)


def quantize_rows(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize float rows `[..., n]` to the stored form of `fmt` (same as ggml's reference).

    Float formats return a cast copy; block formats return uint8 `[..., row_bytes]`.
    """
    if fmt in FLOAT_DTYPES:
        return w.to(FLOAT_DTYPES[fmt]).contiguous()
    if fmt in REPACKED.values():
        gguf = next(k for k, v in REPACKED.items() if v == fmt)
        return repack_rows(quantize_rows(w, gguf), gguf)
    n = w.shape[-1]
    row_bytes(fmt, n)  # validates n
    if fmt in block_codecs.BLOCKS:
        return block_codecs.encode(w, fmt).contiguous()
    lead = w.shape[:-1]
    blk = w.float().reshape(-1, 32)  # [n_blocks, 32]
    if fmt == "mxfp4":
        out = _quantize_mxfp4(blk)
    elif fmt == "q8_0":
        # ggml quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (half away from zero)
        d = blk.abs().amax(dim=1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        v = blk * inv
        q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)
        out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    else:
        # ggml quantize_row_q4_0_ref: d = max / -8 (max = the signed value of largest |x|),
        # q = min(15, (int8)(x / d + 8.5)), truncation toward zero as in C.
        idx = blk.abs().argmax(dim=1, keepdim=True)
        mx = torch.gather(blk, 1, idx)
        d = mx / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(blk * inv + 8.5), max=15).to(torch.uint8)  # [nb, 32]
        qs = q[:, :16] | (q[:, 16:] << 4)
        out = torch.cat([d.to(torch.float16).view(torch.uint8), qs], dim=1)
    return out.reshape(*lead, -1).contiguous()


def dequantize_rows(data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """Inverse of quantize_rows: stored rows `[..., row_bytes]` (or float `[..., n]`) -> float32."""
    if fmt in FLOAT_DTYPES:
        return data.float()
    lead = data.shape[:-1]
    if data.shape[-1] != row_bytes(fmt, n):
        raise ValueError(f"{fmt} rows of {n} elements have {row_bytes(fmt, n)} bytes")
    if fmt in REPACKED.values():
        return _dequantize_repacked(data, fmt, n)
    if fmt in block_codecs.BLOCKS:
        return block_codecs.decode(data, fmt, n)
    size = BLOCKS[fmt][1]
    b = data.reshape(-1, size)
    if fmt == "mxfp4":
        values = torch.tensor(E2M1_X2, dtype=torch.float32, device=data.device)
        qs = b[:, 1:].long()
        q = torch.cat([values[qs & 0xF], values[qs >> 4]], dim=1)
        return (q * _e8m0_half(b[:, :1])).reshape(*lead, n)
    d = b[:, :2].contiguous().view(torch.float16).float()  # [nb, 1]
    if fmt == "q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).float()  # [nb, 32]
    else:
        qs = b[:, 2:].to(torch.int16)  # [nb, 16]
        q = torch.cat([(qs & 0xF) - 8, (qs >> 4) - 8], dim=1).float()
    return (d * q).reshape(*lead, n)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) as float32 of uint8 E8M0 codes, from its bits (ggml_e8m0_to_fp32_half)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _quantize_mxfp4(blk: torch.Tensor) -> torch.Tensor:
    """[nb, 32] f32 -> [nb, 17] uint8 MXFP4 blocks as gguf-py's quantizer makes them: e =
    floor(log2(amax)) - 2 + 127 (0 for an all-zero block), each element the nearest doubled
    e2m1 value times 2^(e - 128), the lower code on a tie."""
    amax = blk.abs().amax(dim=1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax))
    e = e.to(torch.int32).to(torch.uint8)
    values = torch.tensor(E2M1_X2, dtype=torch.float32, device=blk.device)
    err = (_e8m0_half(e)[:, :, None] * values - blk[:, :, None]).abs()  # [nb, 32, 16]
    q = err.argmin(dim=2).to(torch.uint8)
    return torch.cat([e, q[:, :16] | (q[:, 16:] << 4)], dim=1)


def repack_rows(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF rows `[..., row_bytes]` of `fmt` (q8_0, q4_0, mxfp4) -> the same bytes in
    REPACKED[fmt]'s layout [quants of the row][scales of the row][zero padding to ROW_ALIGN];
    pure byte moves (no rounding)."""
    if fmt not in REPACKED:
        raise ValueError(f"only {sorted(REPACKED)} are repacked, got {fmt!r}")
    elems, size = BLOCKS[fmt]
    rb = data.shape[-1]
    if data.dtype != torch.uint8 or rb % size:
        raise ValueError(f"{fmt} rows must be uint8 [..., k * {size}], got {data.dtype} {rb}")
    sb = SCALE_BYTES[fmt]
    blocks = data.reshape(-1, rb // size, size)  # [rows, blocks per row, size]
    quants = blocks[:, :, sb:].reshape(blocks.shape[0], -1)  # [rows, nb * (size - sb)]
    scales = blocks[:, :, :sb].reshape(blocks.shape[0], -1)  # [rows, nb * sb]
    parts = [quants, scales]
    out_rb = row_bytes(REPACKED[fmt], rb // size * elems)
    if out_rb > rb:
        parts.append(data.new_zeros(blocks.shape[0], out_rb - rb))
    return torch.cat(parts, dim=1).reshape(*data.shape[:-1], out_rb)


def _dequantize_repacked(data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """Reference dequantizer of q8_0r / q4_0r / mxfp4r rows `[..., row_bytes]` -> float32
    `[..., n]`."""
    lead = data.shape[:-1]
    rows = data.reshape(-1, data.shape[-1])
    nq = n if fmt == "q8_0r" else n // 2  # quant bytes per row
    if fmt == "mxfp4r":
        values = torch.tensor(E2M1_X2, dtype=torch.float32, device=data.device)
        qs = rows[:, :nq].reshape(rows.shape[0], -1, 16).long()  # [rows, n / 32, 16]
        q = torch.cat([values[qs & 0xF], values[qs >> 4]], dim=2)  # [rows, n / 32, 32]
        d = _e8m0_half(rows[:, nq : nq + n // 32])[:, :, None]
        return (q * d).reshape(*lead, n)
    d = rows[:, nq : nq + n // 16].contiguous().view(torch.float16).float()  # [rows, n / 32]
    d = d.repeat_interleave(32, dim=1)  # [rows, n]: each block's scale on its 32 elements
    if fmt == "q8_0r":
        q = rows[:, :nq].contiguous().view(torch.int8).float()
    else:
        qs = rows[:, :nq].reshape(rows.shape[0], -1, 16).to(torch.int16)  # [rows, n / 32, 16]
        q = torch.cat([(qs & 0xF) - 8, (qs >> 4) - 8], dim=2).reshape(rows.shape[0], n).float()
    return (d * q).reshape(*lead, n)


def quantize_x_q8_ref(x: torch.Tensor) -> torch.Tensor:
    """Activations [..., n] -> their Q8 block approximation d * q, exact in float64 (n % 32 == 0),
    as the C core (pyrt_quantize_x_q8) and the dp4a kernels quantize x: per 32-block
    d = amax / 127 (f32 division), q = round-half-even(x * (1 / d)) (f32 product, C nearbyintf)
    in [-127, 127]. Computed on the CPU whatever x's device: torch on CUDA divides by a scalar
    through its reciprocal, which moves d by an ulp in some blocks and flips their quants (H100:
    3-8% of a batch's values differed from the kernels, which match the C core)."""
    xb = x.detach().float().cpu().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (d.double() * torch.round(xb * inv).double()).reshape(x.shape).to(x.device)


# ----------------------------------------------------------------------------------------------
# activations (torch references of the in-kernel ones)

# Activation name -> the code the kernels take as their ACT constexpr (kernels.expert_rows.act_fn);
# gelu is the tanh approximation (gelu_pytorch_tanh); swiglu_oai is gpt-oss's clamped SwiGLU
# with its alpha and limit (SWIGLU_OAI): act(g) = min(g, limit) * sigmoid(alpha min(g, limit)),
# times clamp(up, -limit, limit) + 1 instead of up (up_ref). A model activation missing here has
# no GPU kernel; swiglu_oai runs on the generic kernels and q4r_pipe only (GENERIC_ONLY).
ACT_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
GENERIC_ONLY = ("swiglu_oai",)
SWIGLU_OAI = (1.702, 7.0)  # (alpha, limit): gpt-oss's, built into the kernels


def generic_only(bias, activation: str) -> bool:
    """Whether experts with these biases (None: none) and this activation run on the generic
    kernels only (kernels.moe_args: biases by global id; GENERIC_ONLY)."""
    return bias is not None or activation in GENERIC_ONLY


def activation_issue(activation: str, swiglu: tuple[float, float]) -> str | None:
    """Why a model's expert activation has no GPU kernel (None: it has one); swiglu: the
    model's (alpha, limit), which the kernels build in (SWIGLU_OAI)."""
    if activation not in ACT_CODES:
        return f"expert activation '{activation}' has no GPU kernel (GPU: {', '.join(ACT_CODES)})"
    as_f32 = torch.tensor(swiglu, dtype=torch.float32)  # the GGUF stores them as f32
    if activation == "swiglu_oai" and not torch.equal(as_f32, torch.tensor(SWIGLU_OAI)):
        return (f"swiglu_oai with alpha, limit = {as_f32.tolist()} has no GPU kernel (the kernels "
                f"build in gpt-oss's {SWIGLU_OAI})")  # fmt: skip
    return None


def act_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g)
    if activation == "gelu":
        return torch.nn.functional.gelu(g, approximate="tanh")
    if activation == "swiglu_oai":
        alpha, limit = SWIGLU_OAI
        g = g.clamp(max=limit)
        return g * torch.sigmoid(alpha * g)
    raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACT_CODES)}")


def up_ref(u: torch.Tensor, activation: str) -> torch.Tensor:
    """What multiplies act(gate): up itself, or swiglu_oai's clamp(up, -limit, limit) + 1."""
    if activation == "swiglu_oai":
        limit = SWIGLU_OAI[1]
        return u.clamp(-limit, limit) + 1
    return u
