"""Experts read from host memory in place into a device buffer, with wide loads, in one launch.

A direct decode step (pyruntime.offload.step_graph) has the GPU compute some of a layer's misses
from the experts' home in host memory (the mapped GGUF, registered with the driver). The expert
kernels read GGUF blocks with byte loads, which cross PCIe at 35-44 GB/s for 2-4 olmoe Q8_0
experts; a plain gather of the same bytes as int32 words reads 45-48 (H100 host,
bench/read_ceilings.py --zero-copy: 50.5 for a plain read of host memory). So the experts are
gathered first, then computed from the buffer in HBM (~50x faster than the gather).

    src    [n_expert, words] int32   the layer's expert tensor, read in place
    dst    [n_buf, words] int32      the buffer (device)
    ids    [k] int                   the token's experts
    codes  [k] int32                 pair j is gathered where codes[j] == CODE ...
    slots  [k] int32                 ... into dst[slots[j]]

Graph-capturable: which experts and where come from device tensors, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, ids_ptr, codes_ptr, slots_ptr, WORDS, CODE: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    j = tl.program_id(0)
    if tl.load(codes_ptr + j) == CODE:
        e = tl.load(ids_ptr + j).to(tl.int64)
        slot = tl.load(slots_ptr + j).to(tl.int64)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < WORDS
        v = tl.load(src_ptr + e * WORDS + o, mask=m)
        tl.store(dst_ptr + slot * WORDS + o, v, mask=m)


def gather_experts(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, codes: torch.Tensor,
                   slots: torch.Tensor, code: int) -> None:  # fmt: skip
    """dst[slots[j]] = src[ids[j]] for each pair j with codes[j] == code (module doc); src and
    dst: contiguous tensors of whole experts, [n, ...] of one dtype, each expert a multiple of
    4 bytes."""
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"gather_experts: src {src.dtype} {list(src.shape)} and dst "
                         f"{dst.dtype} {list(dst.shape)} hold different experts")  # fmt: skip
    nbytes = src[0].numel() * src.element_size()
    if nbytes % 4 or not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError("gather_experts: experts of whole int32 words, contiguous")
    words = nbytes // 4
    block = triton.next_power_of_2(words) if interpreting() else 4096
    grid = (ids.numel(), triton.cdiv(words, block))
    _gather_kernel[grid](src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), ids,
                         codes, slots, words, CODE=code, BLOCK=block,
                         num_warps=1 if interpreting() else 8)  # fmt: skip
