"""Flags in page-locked host memory between a captured CUDA graph and the host, with no launch.

A hybrid decode step captured whole (pyruntime.offload.step_graph) hands each MoE layer's CPU
share to the host and takes its result back without leaving the graph: after the layer's routing
is written to host memory the graph signals (`publish`: the routing, then the step's number into
a host flag, system scope, release: the host that reads the number sees the routing); later it
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
def _publish_kernel(ids_ptr, w_ptr, codes_ptr, h_ptr, logits_ptr, out_ids, out_w, out_codes,
                    out_h, out_logits, flags_ptr, seq_ptr, INDEX, K, N, E,
                    BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One program: the layer's routing into mapped host memory, then the flag (release, after
    # a barrier: every thread's stores land before the host can see the step's number).
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    tl.store(out_ids + kk, tl.load(ids_ptr + kk, mask=km).to(tl.int32), mask=km)
    tl.store(out_w + kk, tl.load(w_ptr + kk, mask=km).to(tl.float32), mask=km)
    tl.store(out_codes + kk, tl.load(codes_ptr + kk, mask=km), mask=km)
    for n0 in range(0, N, BLOCK):
        o = n0 + tl.arange(0, BLOCK)
        tl.store(out_h + o, tl.load(h_ptr + o, mask=o < N).to(tl.float32), mask=o < N)
    for e0 in range(0, E, BLOCK):
        o = e0 + tl.arange(0, BLOCK)
        tl.store(out_logits + o, tl.load(logits_ptr + o, mask=o < E).to(tl.float32), mask=o < E)
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


def publish(
    ids: torch.Tensor,
    weights: torch.Tensor,
    codes: torch.Tensor,
    h: torch.Tensor,
    logits: torch.Tensor,
    out: tuple,
    flags,
    seq: torch.Tensor,
    index: int,
) -> None:
    """One token's routing (ids [k], weights [k], codes [k] int32, h [n], logits [e], on the
    device) into the mapped host tensors out = (ids, weights, codes, h, logits), then
    flags[index] = seq[0] (module doc): one launch for what would be five copies and a
    signal."""
    k, n, e = ids.numel(), h.numel(), logits.numel()
    _publish_kernel[(1,)](ids, weights, codes, h, logits, *out, flags, seq, index, k, n, e,
                          BLOCK_K=triton.next_power_of_2(k), BLOCK=1024, num_warps=4)  # fmt: skip


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
