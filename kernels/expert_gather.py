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

With sparsity, `gather_neuron_rows` moves only some rows of each neuron: the gate rows of
every neuron first, then, once the gate dots and the mask ran on them in HBM, the up and down
rows of the neurons kept (a neuron's three rows are adjacent, so a kept neuron is one run of
two rows): at sparsity s the bytes over PCIe are 1/3 + 2/3 (1 - s) of the expert's.

Graph-capturable: which experts, neurons and where come from device tensors, no host sync.
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


@triton.jit
def _rows_kernel(src_ptr, dst_ptr, ids_ptr, codes_ptr, slots_ptr, idx_ptr, cnt_ptr, F, ROW_W,
                 FIRST: tl.constexpr, N_ROWS: tl.constexpr, CODE: tl.constexpr,
                 HAS_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    # program (j, tile): rows FIRST .. FIRST + N_ROWS - 1 of BLOCK_N neurons of pair j's
    # expert: neurons tile * BLOCK_N + s (HAS_IDX: the neurons idx[j, that] of the first
    # cnt[j] entries); one neuron's rows are contiguous, N_ROWS * ROW_W words
    j = tl.program_id(0)
    if tl.load(codes_ptr + j) != CODE:
        return
    start = tl.program_id(1) * BLOCK_N
    s = start + tl.arange(0, BLOCK_N)
    if HAS_IDX:
        cnt = tl.load(cnt_ptr + j)
        if start >= cnt:  # an empty tile: the grid is sized for every neuron
            return
        sm = s < cnt
        n = tl.load(idx_ptr + j.to(tl.int64) * F + s, mask=sm, other=0).to(tl.int64)
    else:
        sm = s < F
        n = s.to(tl.int64)
    e = tl.load(ids_ptr + j).to(tl.int64)
    slot = tl.load(slots_ptr + j).to(tl.int64)
    src = ((e * F + n) * 3 + FIRST) * ROW_W  # [BLOCK_N] first word of each neuron's rows
    dst = ((slot * F + n) * 3 + FIRST) * ROW_W
    for w0 in range(0, N_ROWS * ROW_W, BLOCK_W):
        o = w0 + tl.arange(0, BLOCK_W)
        m = sm[:, None] & (o < N_ROWS * ROW_W)[None, :]
        v = tl.load(src_ptr + src[:, None] + o[None, :], mask=m)
        tl.store(dst_ptr + dst[:, None] + o[None, :], v, mask=m)


def gather_neuron_rows(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor,
                       codes: torch.Tensor, slots: torch.Tensor, code: int, rows: tuple[int, int],
                       idx: torch.Tensor | None = None,
                       count: torch.Tensor | None = None) -> None:  # fmt: skip
    """As gather_experts, but only rows rows[0] .. rows[1] - 1 (0 gate, 1 up, 2 down) of each
    neuron, at the same place in dst: of every neuron, or (idx [k, n_ff] int32 and count [k]
    int32, kernels.sparse_mask's compaction) of pair j's first count[j] neurons idx[j]. src
    and dst: [n, n_ff, 3, row] expert tensors of one dtype (kernels.expert_formats)."""
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or src.dim() != 4:
        raise ValueError(f"gather_neuron_rows: src {src.dtype} {list(src.shape)} and dst "
                         f"{dst.dtype} {list(dst.shape)} are not [n, n_ff, 3, row] of one "
                         "expert shape")  # fmt: skip
    if not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError("gather_neuron_rows: contiguous expert tensors")
    first, end = rows
    if not 0 <= first < end <= 3:
        raise ValueError(f"gather_neuron_rows: rows {rows} not within the 3 rows of a neuron")
    n_ff = src.shape[1]
    row_bytes = src.shape[3] * src.element_size()
    word = next(w for w in (4, 2, 1) if row_bytes % w == 0)  # the widest load a row allows
    words = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    row_w = row_bytes // word
    span = (end - first) * row_w
    block_n = 8
    block_w = triton.next_power_of_2(span)
    block_w = block_w if interpreting() else min(1024, block_w)  # <= 8 x 4 KiB a program
    has_idx = idx is not None
    grid = (ids.numel(), triton.cdiv(n_ff, block_n))
    _rows_kernel[grid](src.view(-1).view(words), dst.view(-1).view(words), ids, codes, slots,
                       idx if has_idx else codes, count if has_idx else codes, n_ff, row_w,
                       FIRST=first, N_ROWS=end - first, CODE=code, HAS_IDX=has_idx,
                       BLOCK_N=block_n, BLOCK_W=block_w,
                       num_warps=1 if interpreting() else 8)  # fmt: skip
