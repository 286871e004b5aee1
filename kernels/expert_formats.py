"""Weight formats of the routed-expert tensor `ffn_gud_exps` and their torch codecs.

The tensor is `[n_expert, n_ff, 3, n_embd]` row-major (docs/gguf-layout.md): for expert e and
neuron j the rows (gate, up, down^T) are adjacent, each quantized along n_embd. The kernels take
it as a torch tensor:
- float formats (f32, f16, bf16): that dtype, shape `[n_expert, n_ff, 3, n_embd]`;
- block formats (q8_0, q4_0): uint8, shape `[n_expert, n_ff, 3, row_bytes]` (the GGUF bytes).

The codecs here are plain torch (no gguf import) so the GPU benchmark can quantize on a machine
without the gguf package; tests check them against gguf.quants, the reference codecs.
"""

from __future__ import annotations

import torch

# Format name -> integer code passed to the kernels as a tl.constexpr.
FMT_CODES = {"f32": 0, "f16": 0, "bf16": 0, "q8_0": 1, "q4_0": 2}
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Block formats: (elements per block, bytes per block).
BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18)}


def row_bytes(fmt: str, n_embd: int) -> int:
    """Bytes of one stored row of `n_embd` elements."""
    if fmt in FLOAT_DTYPES:
        return n_embd * FLOAT_DTYPES[fmt].itemsize
    if fmt in BLOCKS:
        elems, size = BLOCKS[fmt]
        if n_embd % elems:
            raise ValueError(f"{fmt} rows need n_embd % {elems} == 0, got n_embd={n_embd}")
        return n_embd // elems * size
    raise ValueError(f"unknown expert weight format {fmt!r}; expected one of {sorted(FMT_CODES)}")


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
    n = w.shape[-1]
    row_bytes(fmt, n)  # validates n
    lead = w.shape[:-1]
    blk = w.float().reshape(-1, 32)  # [n_blocks, 32]
    if fmt == "q8_0":
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
    size = BLOCKS[fmt][1]
    b = data.reshape(-1, size)
    d = b[:, :2].contiguous().view(torch.float16).float()  # [nb, 1]
    if fmt == "q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).float()  # [nb, 32]
    else:
        qs = b[:, 2:].to(torch.int16)  # [nb, 16]
        q = torch.cat([(qs & 0xF) - 8, (qs >> 4) - 8], dim=1).float()
    return (d * q).reshape(*lead, n)


# ----------------------------------------------------------------------------------------------
# activations (torch references of the in-kernel ones)

ACTIVATIONS = {"silu": 0, "gelu": 1}  # gelu = tanh approximation (gelu_pytorch_tanh)


def act_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g)
    if activation == "gelu":
        return torch.nn.functional.gelu(g, approximate="tanh")
    raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
