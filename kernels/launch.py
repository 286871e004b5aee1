"""What a launcher needs to know about where its kernel runs: the Triton interpreter (CPU
tensors, TRITON_INTERPRET=1: the tests) or a GPU, that GPU's number of SMs, and the tl.dot input
type of the GEMM kernels for an activation dtype."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU interpreter: big blocks, fp32 dots, no inline asm)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (persistent kernels size their grid by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# tl.dot input types of the GEMM kernels (their DOT constexpr): exact fp32 (ieee), bf16 or f16
# tensor cores; fp32 accumulation in every case.
DOT_F32, DOT_BF16, DOT_F16 = 0, 1, 2


def dot_code(x_dtype: torch.dtype) -> int:
    """The DOT for activations of x_dtype: half types on tensor cores, except under the
    interpreter (its bf16 tl.dot is wrong: fp32 there); f32 x exact."""
    if interpreting():
        return DOT_F32
    return {torch.bfloat16: DOT_BF16, torch.float16: DOT_F16}.get(x_dtype, DOT_F32)
