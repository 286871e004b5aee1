"""What a launcher needs to know about where its kernel runs: the Triton interpreter (CPU
tensors, TRITON_INTERPRET=1: the tests) or a GPU, and that GPU's number of SMs."""

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
