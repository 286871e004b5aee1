"""Routed experts on the C core, in the reference model's expert signature.

`CpuCoreBackend` computes a layer's routed experts on the C core (pyruntime.cpu.core): the weights
are read in place from the mmap, multi-threaded, dense or neuron-sparse; `make_expert_backend`
picks it or the torch reference (pyruntime.model.reference.moe_ffn_torch).
"""

from __future__ import annotations

import sys

import torch

from pyruntime.cpu.core import CoreError, CpuCore
from pyruntime.cpu.threads import resolve_threads
from pyruntime.errors import UsageError
from pyruntime.experts.store import ExpertStore
from pyruntime.model.reference import moe_ffn_torch


class CpuCoreBackend:
    """Routed experts on the C core (pyruntime.cpu.core): the weights are read in place from the
    mmap, multi-threaded, dense or neuron-sparse. Same call signature as `moe_ffn_torch`."""

    def __init__(self, threads: int | None = None, params: dict[str, int] | None = None) -> None:
        self.core = CpuCore(threads, params)

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
            bias=store.bias_pair,
            swiglu=store.swiglu,
        )


EXPERT_BACKENDS = ("auto", "c", "torch")


def make_expert_backend(kind: str = "auto", threads: int | None = None):
    """'c' (the C core), 'torch' (reference), or 'auto' (C core when it is built, else torch).
    threads: the C core's (None: the physical cores; checked by resolve_threads)."""
    if kind == "torch":
        return moe_ffn_torch
    if kind not in EXPERT_BACKENDS:
        raise UsageError(f"unknown expert backend {kind!r} (use auto, c or torch)")
    try:
        return CpuCoreBackend(resolve_threads(threads))
    except CoreError as exc:
        if kind == "c" or "not found" not in str(exc):
            raise
        print(f"warning: {exc}; computing experts with torch instead", file=sys.stderr)
        return moe_ffn_torch
