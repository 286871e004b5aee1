"""Triton kernels for the routed experts of `ffn_gud_exps` (docs/gguf-layout.md).

Each module holds its @triton.jit kernels, a launcher that checks shapes, allocates and launches,
and the plain torch reference beside it. Importing this package needs triton; it does not need a
GPU (tests run the kernels under TRITON_INTERPRET=1).
"""

from kernels.expert_formats import dequantize_rows, quantize_rows, repack_rows, row_bytes
from kernels.moe_dense import moe_dense, moe_dense_ref
from kernels.moe_sparse import (
    moe_gate,
    moe_sparse,
    moe_sparse_fused,
    moe_sparse_ref,
    moe_sparse_split,
    moe_sparse_up_down,
)
from kernels.sparse_mask import sparse_mask, sparse_mask_ref

__all__ = [
    "dequantize_rows",
    "moe_dense",
    "moe_dense_ref",
    "moe_gate",
    "moe_sparse",
    "moe_sparse_fused",
    "moe_sparse_ref",
    "moe_sparse_split",
    "moe_sparse_up_down",
    "quantize_rows",
    "repack_rows",
    "row_bytes",
    "sparse_mask",
    "sparse_mask_ref",
]
