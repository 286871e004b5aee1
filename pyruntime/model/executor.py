"""What a decoding strategy needs from an executor: the contract both executors keep.

An executor runs the model on one kind of device: pyruntime.cpu.executor.CpuExecutor (the C core)
and pyruntime.gpu.executor.GpuExecutor (Triton kernels, CUDA graphs) sit side by side, import
nothing from each other, and share the model description of this package (config, host weights,
KV cache, reference math, stats). Decoding strategies (pyruntime.decoding) see only this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pyruntime.model.config import ModelConfig
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.stats import ExpertStats


@dataclass
class RoutingTrace:
    """What one forward pass routed: for each MoE layer, the top-k experts and the router logits
    of its last token (the one whose logits a decode step returns), for prefetching.

    layers: the MoE layers' indices, ascending (dense-FFN layers have no router).
    ids: [len(layers), k] int64, the chosen experts in order of routing weight.
    logits: [len(layers), n_expert] float32, the router's logits before softmax.
    An executor fills `ids` and `logits` when a trace is passed to forward(); None before.
    """

    layers: list[int]
    ids: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Executor(Protocol):
    config: ModelConfig
    stats: ExpertStats

    def new_cache(self, max_tokens: int) -> KVCache: ...

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
        *,
        k: int | None = None,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        """Logits float32 [n_tokens, n_vocab] on the host (or [1, n_vocab] with last_only) of
        `tokens` at positions cache.n_tokens.., which the cache then holds. k: experts per token
        for this call (None: the model's n_expert_used). routing: filled with what this call
        routed (see RoutingTrace)."""
        ...

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """A hint that `experts` of MoE layer `layer` are about to be used: start bringing them
        closer (page them in from disk, stage them into GPU slots) without waiting. Big/little
        decoding calls it with what the little pass's routers ranked top-K."""
        ...
