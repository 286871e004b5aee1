"""Flags in page-locked host memory between a captured CUDA graph and the host, with no launch.

A hybrid decode step captured whole (pyruntime.offload.step_graph) hands each MoE layer's CPU
share to the host and takes its result back without leaving the graph: after the layer's routing
is written to host memory the graph signals (`place` with publish: the routing and its placement,
then the step's number into a host flag, system scope, release: the host that reads the number
sees the routing); later it
`absorb`s (spins on another host flag until the host wrote the step's number there, after
writing the CPU's partial sum, then adds that sum, read in place, to the GPU's). The step's
number lives on the device (`advance` adds 1 at the start of a replay), so the captured graph
writes a new value each step. A round trip costs ~4.4 us on an
H100 host (bench/read_ceilings.py --zero-copy).

`absorb` gives up after `limit` polls (a host that died must not hang the GPU forever): it then
sets `failed` and goes on; the step's owner checks `failed` after the step.

flags: int32 host flags as a tensor Triton can address (page-locked memory mapped into the
device's address space; under the interpreter, plain CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WAIT_POLLS = 1 << 28  # ~ a minute of polls over PCIe (~0.25 us each) before `absorb` gives up


@triton.jit
def _advance_kernel(seq_ptr):
    tl.store(seq_ptr, tl.load(seq_ptr) + 1)


@triton.jit
def _place_kernel(ids_ptr, w_ptr, h_ptr, logits_ptr, table_ptr, n_direct_ptr, codes_ptr,
                  rows_ptr, map_slots_ptr, map_direct_ptr, out_ids, out_w, out_codes, out_h,
                  out_logits, flags_ptr, seq_ptr, INDEX, K, N, E, N_EXPERT,
                  BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, PUBLISH: tl.constexpr):  # fmt: skip
    # One program. Placement of the token's k pairs: in a slot (table[e] >= 0; code 0), direct
    # (the first n_direct misses by rank; code 1, buffer row = its rank) or CPU (code 2); the
    # two expert maps (-1 elsewhere). PUBLISH: the routing and the codes into mapped host
    # memory, then the flag (release, after a barrier: every thread's stores land before the
    # host can see the step's number).
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    e = tl.load(ids_ptr + kk, mask=km, other=0)
    slot = tl.load(table_ptr + e, mask=km, other=0)
    hit = slot >= 0
    miss = km & (slot < 0)
    rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    direct = miss & (rank < tl.load(n_direct_ptr))
    codes = tl.where(hit, 0, tl.where(direct, 1, 2))
    tl.store(codes_ptr + kk, codes, mask=km)
    tl.store(rows_ptr + kk, rank, mask=km)
    for e0 in range(0, N_EXPERT, BLOCK):
        o = e0 + tl.arange(0, BLOCK)
        tl.store(map_slots_ptr + o, tl.full([BLOCK], -1, tl.int32), mask=o < N_EXPERT)
        tl.store(map_direct_ptr + o, tl.full([BLOCK], -1, tl.int32), mask=o < N_EXPERT)
    tl.debug_barrier()
    tl.store(map_slots_ptr + e, slot, mask=km & hit)
    tl.store(map_direct_ptr + e, rank, mask=direct)
    if PUBLISH:
        tl.store(out_ids + kk, e.to(tl.int32), mask=km)
        tl.store(out_w + kk, tl.load(w_ptr + kk, mask=km).to(tl.float32), mask=km)
        tl.store(out_codes + kk, codes, mask=km)
        for n0 in range(0, N, BLOCK):
            o = n0 + tl.arange(0, BLOCK)
            tl.store(out_h + o, tl.load(h_ptr + o, mask=o < N).to(tl.float32), mask=o < N)
        for e0 in range(0, E, BLOCK):
            o = e0 + tl.arange(0, BLOCK)
            v = tl.load(logits_ptr + o, mask=o < E).to(tl.float32)
            tl.store(out_logits + o, v, mask=o < E)
        tl.debug_barrier()
        tl.atomic_xchg(flags_ptr + INDEX, tl.load(seq_ptr), sem="release", scope="sys")


@triton.jit
def _absorb_kernel(flags_ptr, seq_ptr, failed_ptr, INDEX, LIMIT, y_gpu_ptr, y_cpu_ptr, out_ptr,
                   N, BLOCK: tl.constexpr):  # fmt: skip
    # One program: wait for the host's flag, then out = y_gpu + y_cpu (y_cpu read from mapped
    # host memory with volatile loads: never a copy cached from an earlier step).
    seq = tl.load(seq_ptr)
    seen = tl.load(flags_ptr + INDEX, volatile=True)
    polls = 0
    while (seen != seq) & (polls < LIMIT):
        seen = tl.load(flags_ptr + INDEX, volatile=True)
        polls += 1
    tl.store(failed_ptr, tl.where(seen != seq, 1, tl.load(failed_ptr)))
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK):
        o = n0 + tl.arange(0, BLOCK)
        m = o < N
        y = tl.load(y_gpu_ptr + o, mask=m, other=0.0) + tl.load(y_cpu_ptr + o, mask=m, other=0.0,
                                                                  volatile=True)  # fmt: skip
        tl.store(out_ptr + o, y, mask=m)


def advance(seq: torch.Tensor) -> None:
    """seq [1] int32 (device) += 1, on the current stream."""
    _advance_kernel[(1,)](seq, num_warps=1)


def place(
    ids: torch.Tensor,
    table: torch.Tensor,
    n_direct: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    publish: tuple | None = None,
) -> None:
    """Where each of one token's k pairs is computed, on the device, in one launch: ids [k]
    (the router's), table [n_expert] int32 (expert -> slot, -1: not in one), n_direct [1]
    int32; out = (codes [k] int32: 0 slot, 1 direct, 2 CPU; rows [k] int32: a direct pair's
    row of the gather buffer, its rank among the misses; map_slots, map_direct [n_expert]
    int32: the expert kernels' maps, -1 elsewhere). publish = (weights [k], h [n], logits
    [e], host outputs (ids, weights, codes, h, logits), flags, seq, index): also write the
    routing and the codes into mapped host memory, then flags[index] = seq[0] (module doc)."""
    codes, rows, map_slots, map_direct = out
    k, n_expert = ids.numel(), table.numel()
    if publish is None:
        w = h = logits = ids
        host, flags, seq, index, n, e = (ids,) * 5, ids, ids, 0, 0, 0
    else:
        w, h, logits, host, flags, seq, index = publish
        n, e = h.numel(), logits.numel()
    _place_kernel[(1,)](ids, w, h, logits, table, n_direct, codes, rows, map_slots, map_direct,
                        *host, flags, seq, index, k, n, e, n_expert,
                        BLOCK_K=triton.next_power_of_2(k), BLOCK=1024, PUBLISH=publish is not None,
                        num_warps=4)  # fmt: skip


def absorb(
    flags,
    seq: torch.Tensor,
    failed: torch.Tensor,
    index: int,
    y_gpu: torch.Tensor,
    y_cpu,
    out: torch.Tensor,
    limit: int = WAIT_POLLS,
) -> None:
    """out = y_gpu + y_cpu (y_cpu: mapped host memory) once flags[index] == seq[0]: the wait
    and the host's share's transfer and add in one launch (f32 [n] each)."""
    _absorb_kernel[(1,)](flags, seq, failed, index, limit, y_gpu, y_cpu, out, out.numel(),
                         BLOCK=1024, num_warps=4)  # fmt: skip
