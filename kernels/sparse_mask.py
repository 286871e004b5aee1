"""Activation-sparsity mask: gate output -> act -> |act| >= threshold -> compacted neuron indices.

For each token-expert pair p (one row of the gate output [P, n_ff]) the kernel writes, in
increasing neuron order, the indices j of the neurons it keeps and their act(gate) values into
fixed-size buffers [P, n_ff] (entries at or past count[p] are padding, left unwritten), and the
count [P]. Shapes depend only on (P, n_ff) and the threshold is a device tensor: no host sync,
no data-dependent shapes, so it can be captured in a CUDA graph and the threshold changed
between replays. With an expert map (kernels.moe_args; the pairs' expert ids passed too) a pair
whose expert is not on the device keeps nothing (count 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_formats import ACT_CODES, act_ref
from .expert_rows import act_fn, expert_slot


@triton.jit
def _sparse_mask_kernel(
    gate_ptr,  # [P, F] f32 gate dots
    thr_ptr,  # [1] f32 threshold on |act(gate)|
    idx_ptr,  # [P, F] int32 out: kept neuron indices, compacted
    act_ptr,  # [P, F] f32 out: act(gate) of the kept neurons, same order
    cnt_ptr,  # [P] int32 out: kept neurons per pair
    F,
    ids_ptr,  # HAS_MAP: [P] expert id of each pair
    map_ptr,  # HAS_MAP: [n_expert] int32 expert map
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    if HAS_MAP:
        if expert_slot(ids_ptr, map_ptr, p, HAS_MAP) < 0:  # not on this device
            tl.store(cnt_ptr + p, 0)
            return
    thr = tl.load(thr_ptr)
    count = tl.full((), 0, dtype=tl.int32)
    for n0 in range(0, F, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        nm = n < F
        a = act_fn(tl.load(gate_ptr + p * F + n, mask=nm, other=0.0), ACT)
        keep = (tl.abs(a) >= thr) & nm
        k32 = keep.to(tl.int32)
        pos = count + tl.cumsum(k32, axis=0) - 1  # slot of each kept neuron
        tl.store(idx_ptr + p * F + pos, n, mask=keep)
        tl.store(act_ptr + p * F + pos, a, mask=keep)
        count += tl.sum(k32, axis=0)
    tl.store(cnt_ptr + p, count)


def as_threshold(threshold, device) -> torch.Tensor:
    """A [1] float32 device tensor from a float or a tensor (kept as is when already one)."""
    if isinstance(threshold, torch.Tensor):
        t = threshold.reshape(-1)
        if t.numel() != 1:
            raise ValueError(f"threshold must be one value, got shape {list(threshold.shape)}")
        return t.to(device=device, dtype=torch.float32)
    return torch.full((1,), float(threshold), dtype=torch.float32, device=device)


def sparse_mask(
    gate: torch.Tensor,
    threshold,
    activation: str = "silu",
    block: int | None = None,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
):
    """Compact the neurons with |act(gate)| >= threshold, per row of gate [P, n_ff] f32.

    Returns (idx [P, n_ff] int32, act [P, n_ff] f32, count [P] int32); row p's first count[p]
    entries are valid. expert_map (with topk_ids [T, K], T * K = P): pairs whose expert maps
    to -1 keep nothing.
    """
    if gate.dim() != 2 or gate.dtype != torch.float32 or not gate.is_contiguous():
        raise ValueError(
            f"gate must be contiguous float32 [P, n_ff], got {gate.dtype} {gate.shape}"
        )
    if activation not in ACT_CODES:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACT_CODES)}")
    P, F = gate.shape
    if expert_map is not None and (topk_ids is None or topk_ids.numel() != P):
        raise ValueError(f"an expert map needs the pairs' topk_ids ({P} of them)")
    thr = as_threshold(threshold, gate.device)
    idx = torch.empty(P, F, dtype=torch.int32, device=gate.device)
    act = torch.empty(P, F, dtype=torch.float32, device=gate.device)
    count = torch.empty(P, dtype=torch.int32, device=gate.device)
    block = block or min(1024, triton.next_power_of_2(F))
    ids = count if expert_map is None else topk_ids.reshape(-1).contiguous()
    _sparse_mask_kernel[(P,)](
        gate, thr, idx, act, count, F, ids, count if expert_map is None else expert_map,
        ACT=ACT_CODES[activation], BLOCK=block, HAS_MAP=expert_map is not None,
    )  # fmt: skip
    return idx, act, count


def sparse_mask_ref(gate: torch.Tensor, threshold: float, activation: str = "silu"):
    """Torch reference: (idx [P, n_ff] int32, -1 padded; act [P, n_ff], 0 padded; count [P])."""
    a = act_ref(gate.float(), activation)
    keep = a.abs() >= threshold
    count = keep.sum(dim=1).to(torch.int32)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept first, in order
    valid = torch.arange(gate.shape[1], device=gate.device)[None, :] < count[:, None]
    idx = torch.where(valid, order, -1).to(torch.int32)
    act = torch.where(valid, torch.gather(a, 1, order), 0.0)
    return idx, act, count
