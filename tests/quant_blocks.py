"""Random stored blocks of the formats gguf-py cannot quantize to (the K-quants), for kernel and
dequantization tests: every byte random (all codes, every packed scale/min bit pattern) except
the f16 block scales, which are set to finite values of a chosen size."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# Byte offsets of the f16 super-block scales: (d, dmin) or (d,)
F16_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Largest |code times sub-block scale| (before d): how big a weight is per unit of d
CODE_RANGE = {Q.Q4_K: 15 * 63, Q.Q5_K: 31 * 63, Q.Q6_K: 32 * 128}
# The K-quant formats by name (row lengths a multiple of 256)
K_QUANTS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}


def random_blocks(
    qtype: Q, rows: int, n: int, rng: np.random.Generator, scale: float
) -> np.ndarray:
    """uint8 [rows, row bytes] of random `qtype` blocks whose weights are at most ~`scale`."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n // block
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    for at in F16_SCALES[qtype]:
        # per block, a scale in [0.25, 1] of the largest (the mins' share similar), f16 bytes
        d = scale / CODE_RANGE[qtype] * rng.uniform(0.25, 1.0, (rows, nb))
        raw[:, :, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * size)
