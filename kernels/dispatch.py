"""What the GPU model calls for its routed experts: one entry point per job.

- `prepare_experts(w, fmt, n_embd)`: once, when a layer's experts are staged to the GPU: returns
  the tensor and format the kernels read fastest (never a dequantized copy).
- `moe_experts(...)`: one MoE layer's routed experts for T tokens; dense, or neuron-sparse when a
  threshold is given and T is at most `sparse_max_batch` (the dense/sparse switch, profiled per
  GPU and model by kernels.switch). Graph-capturable: no host synchronization.
"""

from __future__ import annotations

import torch

from kernels.moe_dense import moe_dense
from kernels.moe_sparse import moe_sparse


def prepare_experts(w: torch.Tensor, fmt: str, n_embd: int) -> tuple[torch.Tensor, str]:
    """(weights, fmt) for the kernels, from the GGUF expert tensor already on the device.

    w: float formats [n_expert, n_ff, 3, n_embd] of that dtype; block formats uint8
    [n_expert, n_ff, 3, row_bytes] (kernels.expert_formats). GGUF blocks are read as they are.
    """
    return w, fmt


def moe_experts(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: str,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    activation: str = "silu",
    threshold: float | torch.Tensor | None = None,
    sparse_max_batch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed experts: (y [T, n_embd] f32, active [T, K] int32 neuron counts or None if dense).

    threshold: on |act(gate)| (float or a [1] device tensor); None means dense.
    sparse_max_batch: the largest T for which the sparse path runs; above it the dense kernel
    runs even with a threshold (sparse stops paying once many tokens share the experts' rows).
    """
    T = x.shape[0]
    if threshold is None or T > sparse_max_batch:
        return moe_dense(x, w, fmt, topk_ids, topk_w, activation), None
    return moe_sparse(x, w, fmt, topk_ids, topk_w, threshold, activation)
