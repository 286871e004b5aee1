"""The "last program finishes" pattern: a reduction across programs inside one launch.

At batch 1 a decode step is hundreds of tiny launches, each costing ~2 µs of GPU time whatever it
does; a split reduction (split-K attention, a router GEMV spread over programs then a top-k)
would need a second launch for its combine. Instead every program of a group writes its partial
result, then takes a ticket from a counter in device memory; the program that draws the last
ticket (all the others have written) combines the partials and puts the counter back to 0, so
the next launch (or the next replay of a CUDA graph) finds it zeroed.

Ordering on the GPU (the CUDA threadFenceReduction pattern): every thread's partial stores, then
a CTA barrier, then one acq_rel atomic at GPU scope (the release publishes the CTA's stores,
ordered before it by the barrier); the last program's acquire makes the others' stores visible,
and it reads them with `.cg` loads (L2, never a stale L1 line). Under the interpreter programs run
one after another, which the same code handles.

`counters(device)` is one zeroed int32 buffer per device, shared by every launch that uses it:
launches on one stream run one after another and each leaves its counters at 0. Two launches
running at once on different streams must not share it (the model runs one stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

N_COUNTERS = 4096  # groups one launch may use (e.g. attention heads x tokens)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device | str, n: int = 1) -> torch.Tensor:
    """The device's shared int32 counter buffer (all 0 between launches), at least n long.

    Allocated on first use: call a kernel that uses it once before capturing a CUDA graph (the
    model's warm-up step does), so the allocation and its zeroing stay outside the graph."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if n > N_COUNTERS:
        raise ValueError(f"{n} counters asked, the buffer holds {N_COUNTERS}")
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(N_COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_arrival(cnt_ptr, n_programs):
    """Call after this program's partial stores; True in exactly one program of the n_programs
    sharing *cnt_ptr: the last to arrive, which may then read every partial (with .cg loads) and
    must call `reset_counter` when done."""
    tl.debug_barrier()  # every thread of this program has issued its stores
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == n_programs - 1


@triton.jit
def reset_counter(cnt_ptr):
    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
