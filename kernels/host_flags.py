"""Flags in page-locked host memory between a captured CUDA graph and the host, with no launch.

A hybrid decode step captured whole (pyruntime.offload.step_graph) hands each MoE layer's CPU
share to the host and takes its result back without leaving the graph: after the layer's routing
is copied to host memory the graph `signal`s (writes the step's number into a host flag, system
scope, release: the host that reads the number sees the copies before it); later it `wait`s
(spins on another host flag until the host wrote the step's number there, after writing the
CPU's partial sum). The step's number lives on the device (`advance` adds 1 at the start of a
replay), so the captured graph writes a new value each step. A round trip costs ~4.4 us on an
H100 host (bench/read_ceilings.py --zero-copy).

`wait` gives up after `limit` polls (a host that died must not hang the GPU forever): it then
sets `failed` and returns; the step's owner checks `failed` after the step.

flags: int32 host flags as a tensor Triton can address (page-locked memory mapped into the
device's address space; under the interpreter, plain CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WAIT_POLLS = 1 << 28  # ~ a minute of polls over PCIe (~0.25 us each) before `wait` gives up


@triton.jit
def _advance_kernel(seq_ptr):
    tl.store(seq_ptr, tl.load(seq_ptr) + 1)


@triton.jit
def _signal_kernel(flags_ptr, seq_ptr, INDEX):
    seq = tl.load(seq_ptr)
    tl.atomic_xchg(flags_ptr + INDEX, seq, sem="release", scope="sys")


@triton.jit
def _wait_kernel(flags_ptr, seq_ptr, failed_ptr, INDEX, LIMIT):
    seq = tl.load(seq_ptr)
    seen = tl.load(flags_ptr + INDEX, volatile=True)
    polls = 0
    while (seen != seq) & (polls < LIMIT):
        seen = tl.load(flags_ptr + INDEX, volatile=True)
        polls += 1
    tl.store(failed_ptr, tl.where(seen != seq, 1, tl.load(failed_ptr)))


def advance(seq: torch.Tensor) -> None:
    """seq [1] int32 (device) += 1, on the current stream."""
    _advance_kernel[(1,)](seq, num_warps=1)


def signal(flags, seq: torch.Tensor, index: int) -> None:
    """flags[index] = seq[0] once the stream's earlier work is done (module doc)."""
    _signal_kernel[(1,)](flags, seq, index, num_warps=1)


def wait(flags, seq: torch.Tensor, failed: torch.Tensor, index: int,
         limit: int = WAIT_POLLS) -> None:  # fmt: skip
    """The stream's later work waits until flags[index] == seq[0] (at most `limit` polls, then
    failed[0] = 1)."""
    _wait_kernel[(1,)](flags, seq, failed, index, limit, num_warps=1)
