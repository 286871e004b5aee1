"""MXFP4 weights as OpenAI's gpt-oss checkpoints store them, decoded to float32 on read.

A checkpoint tensor `X` stored in MXFP4 is two tensors (transformers' integrations/mxfp4.py):
`X_blocks` uint8 [*prefix, rows, G, 16] and `X_scales` uint8 [*prefix, rows, G]. Row r holds
G * 32 elements; group g of it is the 16 bytes blocks[r, g] and one E8M0 scale byte s:
element 2i is the e2m1 code in the low nibble of byte i, element 2i + 1 the high nibble, each
times 2^(s - 127). (ggml's MXFP4, the GGUF type, orders the nibbles differently: element i low,
i + 16 high; the converter re-quantizes from floats, see pyruntime.gguf.quant.)
"""

from __future__ import annotations

import numpy as np

from pyruntime.errors import ConversionError

# e2m1 code -> value (OCP Microscaling Formats v1.0, table 5): sign bit 3, then 0, 0.5, ..., 6
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E8M0_NAN = 0xFF  # the one E8M0 code that is not a power of two


def decode_hf_mxfp4(
    blocks: np.ndarray, scales: np.ndarray, name: str, index: tuple[int, ...] = ()
) -> np.ndarray:
    """blocks uint8 [rows, G, 16], scales uint8 [rows, G] (`X_blocks[index]`, `X_scales[index]`
    of the checkpoint tensor `name` = X) -> float32 [rows, G * 32]; a NaN scale (0xFF) is a
    ConversionError naming the tensor and the block."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ConversionError(
            f"tensor {name}_blocks has shape {list(blocks.shape)}, which does not match its "
            f"scales {list(scales.shape)} (expected scales' shape + [16])"
        )
    bad = np.argwhere(scales == E8M0_NAN)
    if len(bad):
        at = [*index, *bad[0].tolist()]
        raise ConversionError(
            f"tensor {name}_scales: scale block {at} is 0xFF (E8M0 NaN); the checkpoint is corrupt"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [rows, G, 16, 2]: 2i low, 2i+1 high
    values = E2M1[codes].reshape(*scales.shape, 32)
    exponent = scales.astype(np.int32) - 127
    return np.ldexp(values, exponent[..., None]).reshape(scales.shape[0], -1)
