"""What the GPU model calls for its routed experts: one entry point per job.

- `prepare_experts(w, fmt, n_embd)`: once, when a layer's experts are staged to the GPU: returns
  the tensor and format the kernels read fastest (never a dequantized copy).
- `moe_experts(...)`: one MoE layer's routed experts for T tokens, on the path
  kernels.expert_paths.expert_path picks (dense, or neuron-sparse where the layer's profiled
  switch says so), optionally over a subset of the experts (an expert map, kernels.moe_args).
  Graph-capturable: no host synchronization.
"""

from __future__ import annotations

import torch

from .expert_formats import REPACKED, check_expert_tensor, generic_only, repack_rows, row_bytes
from .expert_paths import SPARSE_PATHS, SparseSwitch, expert_path
from .moe_dense import moe_dense
from .moe_sparse import moe_sparse


def prepare_experts(w: torch.Tensor, fmt: str, n_embd: int) -> tuple[torch.Tensor, str]:
    """(weights, fmt) for the kernels, from the GGUF expert tensor already on the device.

    w: float formats [n_expert, n_ff, 3, n_embd] of that dtype; block formats uint8
    [n_expert, n_ff, 3, row_bytes] (kernels.expert_formats). Float formats are used as they
    are; Q8_0 / Q4_0 / MXFP4 are repacked on the device into q8_0r / q4_0r / mxfp4r (same
    bytes, each row's quants then its scales: 16-byte aligned loads; mxfp4r rows padded to 16
    bytes), a few experts at a time so the temporary is small. The caller drops its reference
    to the GGUF tensor afterwards.
    """
    check_expert_tensor(w, fmt, n_embd)
    if fmt not in REPACKED:
        return w, fmt
    out = w.new_empty(*w.shape[:-1], row_bytes(REPACKED[fmt], n_embd))
    step = max(1, (64 << 20) // max(1, w[0].numel()))  # experts per chunk: <= ~64 MiB temporary
    for e0 in range(0, w.shape[0], step):
        out[e0 : e0 + step] = repack_rows(w[e0 : e0 + step], fmt)
    return out, REPACKED[fmt]


def moe_experts(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: str,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    activation: str = "silu",
    threshold: float | torch.Tensor | None = None,
    switch: SparseSwitch | None = None,
    expert_map: torch.Tensor | None = None,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed experts: (y [T, n_embd] f32, active [T, K] int32 neuron counts or None if dense).

    threshold: on |act(gate)| (float or a [1] device tensor); None means dense.
    switch: at which batch sizes the sparse path runs (kernels.switch); elsewhere, and when it
    is None, the dense kernel runs even with a threshold (sparse stops paying once many tokens
    share the experts' rows, and can lose to a fast dense kernel at one token).
    expert_map: int32 [n_expert] global expert id -> slot of w (-1: not on this device, the pair
    is skipped and counts 0 active neurons); None: w holds every expert.
    bias: the experts' biases by global id (kernels.moe_args); with them, or a GENERIC_ONLY
    activation, the generic kernels run (kernels.expert_paths.GENERIC_PATHS).
    """
    generic = generic_only(bias, activation)
    path = expert_path(fmt, x.shape[1], x.shape[0], None if threshold is None else switch,
                       generic)  # fmt: skip
    if path in SPARSE_PATHS:
        return moe_sparse(x, w, fmt, topk_ids, topk_w, threshold, activation, path,
                          expert_map=expert_map, bias=bias)  # fmt: skip
    y = moe_dense(x, w, fmt, topk_ids, topk_w, activation, path, expert_map=expert_map, bias=bias)
    return y, None
