"""Routed-expert FFN on the CPU: y[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]).

Two interchangeable implementations:
- `moe_ffn_torch`: plain PyTorch over dequantized experts (the reference; also the fallback when
  the C core is not built);
- the C core (pyruntime.cpu_core), multi-threaded, reading the quantized rows in place, dense or
  neuron-sparse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyruntime.experts.store import ExpertStore


def activation_fn(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu":  # tanh approximation (HF "gelu_pytorch_tanh", "gelu_new")
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu_exact":
        return F.gelu
    raise ValueError(f"unknown activation '{name}'")


def expert_ffn_torch(
    w: torch.Tensor, x: torch.Tensor, act: str, threshold: float | None = None
) -> tuple[torch.Tensor, int]:
    """One expert: w [n_ff, 3, n_embd] (gate, up, down^T rows), x [T, n_embd] -> (y, active).

    With `threshold`, neurons whose |act(gate . x)| < threshold contribute nothing (their up/down
    rows are skipped by the fast kernels); `active` counts the (token, neuron) pairs kept.
    """
    g = activation_fn(act)(x @ w[:, 0, :].T)  # [T, n_ff]
    if threshold is not None:
        keep = g.abs() >= threshold
        g = g * keep
        active = int(keep.sum())
    else:
        active = g.numel()
    h = g * (x @ w[:, 1, :].T)  # [T, n_ff]
    return h @ w[:, 2, :], active  # [T, n_embd]


def moe_ffn_torch(
    store: ExpertStore,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    act: str,
    threshold: float | None = None,
) -> tuple[torch.Tensor, int]:
    """x: [T, n_embd] f32; topk_ids: [T, K] int; topk_w: [T, K] f32 -> (y [T, n_embd], n_active)."""
    y = torch.zeros_like(x)
    n_active = 0
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        out, active = expert_ffn_torch(store.expert_weights(e), x[tok], act, threshold)
        y.index_add_(0, tok, out * topk_w[tok, slot].unsqueeze(1))
        n_active += active
    return y, n_active


def route(
    router_logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k, optional renormalization (docs/gguf-layout.md).

    router_logits: [T, n_expert] -> (ids [T, k] int64, weights [T, k] f32).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def sparsity(n_active: int, n_pairs: int, n_ff: int) -> float:
    """Fraction of neurons skipped over `n_pairs` (token, expert) computations."""
    total = n_pairs * n_ff
    return 0.0 if total == 0 else 1.0 - n_active / total


class CpuCoreBackend:
    """Routed experts on the C core (pyruntime.cpu_core): the weights are read in place from the
    mmap, multi-threaded, dense or neuron-sparse. Same call signature as `moe_ffn_torch`."""

    def __init__(self, threads: int | None = None) -> None:
        from pyruntime.cpu_core import CpuCore

        self.core = CpuCore(threads)

    def __call__(
        self,
        store: ExpertStore,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_w: torch.Tensor,
        act: str,
        threshold: float | None = None,
    ) -> tuple[torch.Tensor, int]:
        return self.core.moe_ffn(
            store.raw,
            int(store.qtype),
            store.n_expert,
            store.n_ff,
            store.n_embd,
            x.contiguous(),
            topk_ids,
            topk_w,
            act,
            threshold,
        )


def make_expert_backend(kind: str = "auto", threads: int | None = None):
    """'c' (the C core), 'torch' (reference), or 'auto' (C core when it is built, else torch)."""
    if kind == "torch":
        return moe_ffn_torch
    if kind not in ("c", "auto"):
        raise ValueError(f"unknown expert backend '{kind}' (use auto, c or torch)")
    from pyruntime.cpu_core import CoreError

    try:
        return CpuCoreBackend(threads)
    except CoreError as exc:
        if kind == "c" or "not found" not in str(exc):
            raise
        import sys

        print(f"warning: {exc}; computing experts with torch instead", file=sys.stderr)
        return moe_ffn_torch
