"""Arguments and output buffers shared by the routed-expert launchers (moe_dense, moe_q8r,
moe_sparse): one check of (x, w, routing, activation, expert map), the per-pair routing arrays,
the zeroed outputs, and the experts' biases (gpt-oss).

Biases (`bias`): None, or (gate_up [n_expert, F, 2] f32: neuron j's gate and up bias, down
[n_expert, H] f32: added to each expert's output before its routing weight), indexed by the
global expert id (a cache of expert slots keeps the biases of every expert on the device).
They, and the activations in GENERIC_ONLY, run on the generic kernels: "gemv", "gemm"
(moe_dense) and "fused" (moe_sparse), the gate and up biases inside the kernels, the down bias
after them (add_down_bias); and on the 4-bit "q4r_pipe" (kernels.moe_q4r_pipe), all inside.

The expert map (vLLM fused_moe's `expert_map`): an int32 device tensor [n_expert] from a global
expert id (what topk_ids holds) to a slot of the expert tensor w, which then holds n_slots
experts (w.shape[0]); -1 means "not on this device": that (token, expert) pair is skipped (it
adds nothing to y, its active count stays 0). None is the identity (w holds every expert), with
no map load in the kernels (a constexpr branch). The map's values are read on the device only
(no host sync: graph-capturable), so they are not checked here: ids must be < n_expert and
slots in [-1, n_slots).
"""

from __future__ import annotations

import torch

from .expert_formats import ACT_CODES, FMT_CODES, check_expert_tensor, generic_only, row_bytes


def check_moe_args(x, w, fmt, topk_ids, topk_w, activation, expert_map=None, bias=None,
                   generic=False):  # fmt: skip
    """Validate the common arguments; return (H, n_slots, F, RB, T, K): n_embd, experts in w,
    neurons per expert, row stride of w (elements for float formats, bytes for block formats),
    tokens, experts per token. generic: the caller is a generic kernel (biases and the
    GENERIC_ONLY activations allowed)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"x must be [T, n_embd] float32 or bfloat16, got {x.dtype} {list(x.shape)}"
        )
    if x.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    T, H = x.shape
    E, F = check_expert_tensor(w, fmt, H)
    if topk_ids.shape != topk_w.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(
            f"topk_ids {list(topk_ids.shape)} and topk_w {list(topk_w.shape)} "
            f"must both be [T={T}, K]"
        )
    if activation not in ACT_CODES:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACT_CODES)}")
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_w", topk_w)):
        if tensor.device != w.device:
            raise ValueError(f"{name} is on {tensor.device}, the expert tensor on {w.device}")
    if not generic and generic_only(bias, activation):
        raise ValueError(
            f"expert biases and activation {activation!r} run on the generic kernels only "
            "(moe_dense 'gemv' / 'gemm', moe_sparse 'fused')"
        )
    check_expert_map(expert_map, w.device)
    check_bias(bias, n_expert_of(w, expert_map), F, H, w.device)
    rb = H if FMT_CODES[fmt] == 0 else row_bytes(fmt, H)
    return H, E, F, rb, T, topk_ids.shape[1]


def check_expert_map(expert_map: torch.Tensor | None, device: torch.device) -> None:
    """An expert map must be a contiguous int32 [n_expert] tensor on the experts' device."""
    if expert_map is None:
        return
    if expert_map.dtype != torch.int32 or expert_map.dim() != 1 or not expert_map.is_contiguous():
        raise ValueError(
            f"expert_map must be a contiguous int32 [n_expert] tensor, got {expert_map.dtype} "
            f"{list(expert_map.shape)}"
        )
    if expert_map.device != device:
        raise ValueError(f"expert_map is on {expert_map.device}, the expert tensor on {device}")


def check_bias(bias, n_expert: int, F: int, H: int, device: torch.device) -> None:
    """Biases: (gate_up [n_expert, F, 2], down [n_expert, H]) contiguous f32 on the device."""
    if bias is None:
        return
    want = ((n_expert, F, 2), (n_expert, H))
    for t, shape, name in zip(bias, want, ("gate_up", "down"), strict=True):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"bias {name} must be contiguous float32 {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")  # fmt: skip
        if t.device != device:
            raise ValueError(f"bias {name} is on {t.device}, the expert tensor on {device}")


def bias_args(bias, placeholder: torch.Tensor) -> dict:
    """The launch arguments of optional biases: the gate/up biases' pointer (a placeholder,
    never read, when there are none) and the HAS_BIAS constexpr."""
    return dict(bias_ptr=placeholder if bias is None else bias[0], HAS_BIAS=bias is not None)


def add_down_bias(y, topk_ids, topk_w, bias, expert_map=None):
    """y [T, H] + sum_k topk_w[t, k] * down_bias[topk_ids[t, k]] over the pairs computed here
    (an expert map's -1 pairs add nothing); y itself without biases. Graph-safe (no sync)."""
    if bias is None:
        return y
    ids = topk_ids.long()
    w = topk_w.float()
    if expert_map is not None:
        w = w * (expert_map[ids] >= 0)
    return y + torch.einsum("tk,tkh->th", w, bias[1][ids])


def map_args(expert_map: torch.Tensor | None, placeholder: torch.Tensor) -> dict:
    """The launch arguments of an optional map: its pointer (a placeholder tensor when there
    is none, never read) and the HAS_MAP constexpr."""
    return dict(map_ptr=placeholder if expert_map is None else expert_map,
                HAS_MAP=expert_map is not None)  # fmt: skip


def n_expert_of(w: torch.Tensor, expert_map: torch.Tensor | None) -> int:
    """Global experts the routing ids range over: the map's length, else w's experts."""
    return w.shape[0] if expert_map is None else expert_map.numel()


def flat_routing(topk_ids, topk_w):
    """(expert ids [P], routing weights [P] f32), contiguous: the per-pair arrays the kernels
    index with the pair p = token * K + slot."""
    return topk_ids.reshape(-1).contiguous(), topk_w.reshape(-1).float().contiguous()


def zeroed_out_and_count(T: int, H: int, P: int, device):
    """(y [T, H] f32, count [P] int32), both zero, from one allocation: one memset node in a
    CUDA graph instead of two (each node costs ~2 us at batch 1)."""
    buf = torch.zeros(T * H + P, dtype=torch.float32, device=device)
    return buf[: T * H].view(T, H), buf[T * H :].view(torch.int32)
