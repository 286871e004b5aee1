"""The routed-expert tensor's formats as sizes and names: what a row of each format weighs, which
GGUF formats have a repacked form, the kernels' format codes. Plain Python (no torch): the GPU
plan (`pyruntime info --gpu-mem`, pyruntime.offload.plan) sizes a model with it without loading
torch. The layouts themselves, and the torch codecs, are kernels.expert_formats'.
"""

from __future__ import annotations

# Format name -> integer code passed to the kernels as a tl.constexpr.
# Odd codes: the Q8_0 family (one int8 per element); even non-zero: 4-bit elements in Q4_0's
# nibble order (kernels.expert_rows.q4_blocks).
# The 5-bit and K-quant formats take the Q8_0 family's path with their own block decode
# (kernels.expert_rows.q8_blocks): 32 values per block of 32 (a K-quant sub-block).
FMT_CODES = {
    "f32": 0, "f16": 0, "bf16": 0, "q8_0": 1, "q4_0": 2, "q8_0r": 3, "q4_0r": 4, "mxfp4": 6,
    "mxfp4r": 8, "q5_0": 7, "q5_1": 9, "q4_k": 11, "q5_k": 13, "q6_k": 15,
}  # fmt: skip
# Float formats -> bytes per element (kernels.expert_formats.FLOAT_DTYPES: their torch dtypes)
FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
# The 5-bit and K-quant formats' blocks (kernels.block_codecs: their codecs): (elements, bytes)
CODEC_BLOCKS = {"q5_0": (32, 22), "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176),
                "q6_k": (256, 210)}  # fmt: skip
# Block formats: (elements per block, bytes per block).
BLOCKS = {
    "q8_0": (32, 34), "q4_0": (32, 18), "q8_0r": (32, 34), "q4_0r": (32, 18), "mxfp4": (32, 17),
    "mxfp4r": (32, 17), **CODEC_BLOCKS,  # q5_0, q5_1 (32 elements), q4_k, q5_k, q6_k (256)
}  # fmt: skip
# e2m1 code -> value doubled (ggml's kvalues_mxfp4); an MXFP4 block's scale is then 2^(e - 128)
E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# GGUF block format -> its repacked form (same bytes, regrouped per row).
REPACKED = {"q8_0": "q8_0r", "q4_0": "q4_0r", "mxfp4": "mxfp4r"}
# Repacked formats whose rows are padded with zero bytes to a multiple of this many bytes.
ROW_ALIGN = {"mxfp4r": 16}
# Bytes of one block's scale in the GGUF block (first) and in the repacked row's tail.
SCALE_BYTES = {"q8_0": 2, "q4_0": 2, "mxfp4": 1}


def format_family(fmt: str) -> str:
    """'float', 'block' (GGUF blocks: byte loads) or 'packed' (REPACKED's values: wide loads):
    what the launch configs of the generic kernels are keyed by."""
    if fmt in REPACKED.values():
        return "packed"
    return "block" if fmt in BLOCKS else "float"


def q8r_supported(fmt: str, n_embd: int) -> bool:
    """Whether the q8_0r kernels (kernels.moe_q8r: dp4a on whole rows loaded as int32 words)
    take this layer: q8_0r rows that start 4-byte aligned (34 n_embd / 32 bytes a row)."""
    return fmt == "q8_0r" and n_embd % 64 == 0


def q4r_supported(fmt: str, n_embd: int) -> bool:
    """Whether the 4-bit dp4a kernel (kernels.moe_q4r_pipe) takes this layer: q4_0r or mxfp4r
    rows of any n_embd (a multiple of 32; q4_0r rows 2-byte aligned when n_embd % 64 == 32
    load as 16-bit halves)."""
    return fmt in ("q4_0r", "mxfp4r") and n_embd % 32 == 0


def row_bytes(fmt: str, n_embd: int) -> int:
    """Bytes of one stored row of `n_embd` elements."""
    if fmt in FLOAT_BYTES:
        return n_embd * FLOAT_BYTES[fmt]
    if fmt in BLOCKS:
        elems, size = BLOCKS[fmt]
        if n_embd % elems:
            raise ValueError(f"{fmt} rows need n_embd % {elems} == 0, got n_embd={n_embd}")
        align = ROW_ALIGN.get(fmt, 1)
        return -(-n_embd // elems * size // align) * align
    raise ValueError(f"unknown expert weight format {fmt!r}; expected one of {sorted(FMT_CODES)}")
