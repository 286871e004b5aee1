"""Token-expert pairs grouped by expert into BLOCK_M-row blocks, for the grouped GEMMs of the
"gemm" paths (kernels.moe_dense, kernels.moe_sparse): what vLLM's moe_align_block_size does.

    sorted_pairs [n_blocks * BLOCK_M] int32   pair ids, each expert's pairs in one segment padded
                                              to a multiple of BLOCK_M rows; P marks padding
    block_expert [n_blocks] int32             the expert of each block (blocks past `total`: any)
    total        [1] int32                    rows of the segments (blocks at or past it exit)

The sizes depend only on (P, n_expert, BLOCK_M), never on the routing: no host synchronization,
so a step with it can be captured in a CUDA graph. Two launches (plus a zero-fill and a fill):
`_align_rank_kernel`, per chunk of pairs, adds the chunk's per-expert counts to the global ones
with atomics and keeps each pair's rank among its expert's pairs (the atomic's old value plus
the rank inside the chunk); `_align_scatter_kernel` turns the counts into padded segment starts
(a cumsum over n_expert values, redone by every program) and writes each pair at its start +
rank, and the block -> expert table. The order of an expert's pairs inside its segment follows
the atomics (it may change from run to run); every pair's row of the GEMMs is computed the
same way wherever it sits, so the results do not depend on it. (The torch version it replaced
took ~28 launches a layer: on a prompt of a few hundred tokens the host's launch time, not the
GPU, set the pace.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 128  # pairs per program


@triton.jit
def _align_rank_kernel(ids_ptr, counts_ptr, rank_ptr, P, E, BLOCK: tl.constexpr,
                       E_PAD: tl.constexpr):  # fmt: skip
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pm = p < P
    e = tl.load(ids_ptr + p, mask=pm, other=-1).to(tl.int32)  # -1 matches no expert
    ex = tl.arange(0, E_PAD)
    onehot = (e[:, None] == ex[None, :]).to(tl.int32)  # [BLOCK, E_PAD]
    n = tl.sum(onehot, axis=0)  # [E_PAD] this chunk's pairs per expert
    base = tl.atomic_add(counts_ptr + ex, n, mask=n > 0, sem="relaxed")  # earlier chunks'
    base = tl.where(n > 0, base, 0)
    before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in the chunk
    rank = tl.sum(onehot * (before + base[None, :]), axis=1)
    tl.store(rank_ptr + p, rank, mask=pm)


@triton.jit
def _align_scatter_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_ptr, blk_expert_ptr, total_ptr,
                          P, E, n_blocks, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                          E_PAD: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    em = ex < E
    counts = tl.load(counts_ptr + ex, mask=em, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)  # [E_PAD] end row of each expert's segment
    start = end - padded
    p = pid * BLOCK + tl.arange(0, BLOCK)
    pm = p < P
    e = tl.load(ids_ptr + p, mask=pm, other=-1).to(tl.int32)
    onehot = (e[:, None] == ex[None, :]).to(tl.int32)
    dest = tl.sum(onehot * start[None, :], axis=1) + tl.load(rank_ptr + p, mask=pm, other=0)
    tl.store(sorted_ptr + dest, p, mask=pm)
    # this program's share of the block table: a block's expert is the number of segments
    # that end at or before its first row
    b = pid * BLOCK + tl.arange(0, BLOCK)
    first = b * BLOCK_M
    ended = (end[None, :] <= first[:, None]) & em[None, :]
    expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), E - 1)
    tl.store(blk_expert_ptr + b, expert, mask=b < n_blocks)
    if pid == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))


def align_sizes(n_pairs: int, n_expert: int, block_m: int) -> int:
    """Blocks of the grouping: every expert's segment may waste up to block_m - 1 rows."""
    max_padded = n_pairs + min(n_expert, n_pairs) * (block_m - 1)
    return triton.cdiv(max_padded, block_m)


def moe_align(topk_ids: torch.Tensor, n_expert: int, block_m: int):
    """(sorted_pairs, block_expert, total) of topk_ids [T, K] (int32 or int64, values in
    [0, n_expert)) as the module docstring describes."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    P = ids.numel()
    n_blocks = align_sizes(P, n_expert, block_m)
    counts = torch.zeros(n_expert, dtype=torch.int32, device=dev)
    rank = torch.empty(P, dtype=torch.int32, device=dev)
    sorted_pairs = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(n_expert)
    _align_rank_kernel[(triton.cdiv(P, ALIGN_CHUNK),)](
        ids, counts, rank, P, n_expert, BLOCK=ALIGN_CHUNK, E_PAD=e_pad
    )
    grid = triton.cdiv(max(P, n_blocks), ALIGN_CHUNK)
    _align_scatter_kernel[(grid,)](
        ids, counts, rank, sorted_pairs, block_expert, total, P, n_expert, n_blocks,
        BLOCK_M=block_m, BLOCK=ALIGN_CHUNK, E_PAD=e_pad,
    )  # fmt: skip
    return sorted_pairs, block_expert, total


def moe_align_ref(topk_ids: torch.Tensor, n_expert: int, block_m: int):
    """Plain torch: the same grouping with each expert's pairs in pair order (tests)."""
    flat = topk_ids.reshape(-1).long().cpu()
    P = flat.numel()
    n_blocks = align_sizes(P, n_expert, block_m)
    sorted_pairs = torch.full((n_blocks * block_m,), P, dtype=torch.int32)
    block_expert = torch.full((n_blocks,), n_expert - 1, dtype=torch.int32)
    row = 0
    for e in range(n_expert):
        pairs = (flat == e).nonzero().flatten()
        n = triton.cdiv(pairs.numel(), block_m) * block_m
        sorted_pairs[row : row + pairs.numel()] = pairs.to(torch.int32)
        block_expert[row // block_m : (row + n) // block_m] = e
        row += n
    return sorted_pairs, block_expert, torch.tensor([row], dtype=torch.int32)
