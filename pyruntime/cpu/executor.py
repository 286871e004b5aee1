"""The CPU executor: the reference model's math with the C core doing the heavy parts.

Prefill (several tokens) runs the reference forward (pyruntime.model.reference) with the C core's
`linear` for every weight matrix (read in place, in its stored format) and its routed-expert
kernel; a one-token decode step is one C call (pyruntime.cpu.decoder: embedding, every block and
the output matrix on the core's thread pool, no torch op in between). Without the C core (or with
expert_backend='torch') it is the plain torch reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pyruntime.cpu.core import CpuCore
from pyruntime.cpu.decoder import CpuDecoder
from pyruntime.cpu.experts import make_expert_backend
from pyruntime.errors import UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.reference import ReferenceModel, check_k
from pyruntime.model.tokens import single_token
from pyruntime.model.weights import HostWeights


class CpuExecutor(ReferenceModel):
    """Forward pass on the CPU. `forward` returns float32 logits [n_tokens, n_vocab]."""

    def __init__(self, cfg: ModelConfig, weights: HostWeights) -> None:
        super().__init__(cfg, weights)
        # The C core when routed experts run on it: then the dense matrices run on it too, and a
        # one-token forward is one C call per token (CpuDecoder).
        self.core: CpuCore | None = None
        self._decoder: CpuDecoder | None = None
        self.file: GGUFFile | None = None  # the mapped file, for prefetch hints

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Start paging the experts' bytes in from the file (readahead), without waiting."""
        if self.file is not None:
            for e in experts:
                self.file.advise_willneed(self.weights.expert(layer, e).data)

    @classmethod
    def from_gguf(
        cls, f: GGUFFile, threads: int | None = None, expert_backend: str = "auto"
    ) -> CpuExecutor:
        """expert_backend: 'auto' (C core when built), 'c' or 'torch' (the reference)."""
        if threads is not None:
            if threads < 1:
                raise UsageError(f"--threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        cfg = ModelConfig.from_gguf(f)
        model = cls(cfg, HostWeights.from_gguf(f, cfg))
        model.file = f
        model.expert_backend = make_expert_backend(expert_backend, threads)
        core = getattr(model.expert_backend, "core", None)
        if core is not None:
            model.use_core(core)
        return model

    def use_core(self, core: CpuCore) -> None:
        """Compute dense matrices and one-token decode steps on `core`."""
        self.core = core
        self.linear = self._core_linear
        self._decoder = CpuDecoder(self.config, self.weights, core)
        # One thread pool for everything: torch only runs the few ops left on the prefill path
        # (attention, norms), and its threads would otherwise compete with the pool's.
        torch.set_num_threads(1)

    def _core_linear(self, x: torch.Tensor, w: QuantMatrix, bias: torch.Tensor | None = None):
        """x [T, n_in] -> [T, n_out] on the C core, w in its own format."""
        return self.core.linear(w.raw, int(w.qtype), w.shape[0], w.shape[1], x, bias)

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
        *,
        k: int | None = None,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        """Logits [n_tokens, n_vocab] (or [1, n_vocab] with last_only) float32 (the Executor
        protocol: pyruntime.model.executor)."""
        if self._decoder is not None and self.gate_observer is None:
            token = single_token(tokens, self.config.n_vocab)
            if token is not None:  # decode: one C call, no torch op (~15 us of Python)
                return self._decode(token, cache, check_k(k, self.config), routing)
        return self._forward_torch(tokens, cache, last_only, k, routing)

    def _decode(
        self, token: int, cache: KVCache, k: int, routing: RoutingTrace | None
    ) -> torch.Tensor:
        """One token through the C decode step; logits [1, n_vocab]."""
        cache.reserve(1)
        cfg = self.config
        ids = logits = None
        if routing is not None:
            ids = torch.empty((cfg.n_layer, k), dtype=torch.int32)
            logits = torch.empty((cfg.n_layer, cfg.n_expert), dtype=torch.float32)
        out, n_active = self._decoder.step(
            token,
            cache,
            self.expert_threshold,
            k=None if k == cfg.n_expert_used else k,
            route_ids=ids,
            route_logits=logits,
        )
        self.stats.add(n_pairs=self._decoder.n_pairs, n_active=n_active, n_ff=cfg.n_ff_exp)
        if routing is not None:
            layers = self.moe_layers()
            routing.layers = layers
            routing.ids = ids[layers].long() if layers else None
            routing.logits = logits[layers] if layers else None
        return out

    def decode_times(self, reset: bool = False) -> dict[str, float]:
        """Seconds of the C decode steps by part (CpuDecoder.times); {} without the C core."""
        return {} if self._decoder is None else self._decoder.times(reset)
