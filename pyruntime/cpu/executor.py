"""The CPU executor: the reference model's math with the C core doing the heavy parts.

With the C core, every forward pass is one C call (pyruntime.cpu.decoder): a one-token decode
step, or a prefill of several tokens, chunk by chunk (`ubatch` tokens each: batched matrix
products, each routed expert once per chunk for its tokens, the chunk's attention over the
cache), with no torch op in between. Without the C core (expert_backend='torch'), or while a
calibration observer watches the experts' inputs (gate_observer), it is the reference forward
(pyruntime.model.reference), with the C core's `linear` for every weight matrix (read in place,
in its stored format) and its routed-expert kernel where the core is there; so is every forward
pass of a model with Gated DeltaNet layers or llama4's layers (c_decoder_runs);
a DeltaNet layer's decode step is one C call (pyruntime.cpu.deltanet).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pyruntime.cpu import sparse_switch
from pyruntime.cpu.core import CpuCore
from pyruntime.cpu.decoder import CpuDecoder
from pyruntime.cpu.deltanet import CDeltaNet
from pyruntime.cpu.experts import make_expert_backend
from pyruntime.errors import UsageError
from pyruntime.experts import gates
from pyruntime.gguf.file import GGUFFile
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.mla import heads_linear
from pyruntime.model.reference import ReferenceModel, check_k
from pyruntime.model.tokens import single_token, token_ids
from pyruntime.model.weights import HostWeights


def c_decoder_runs(cfg: ModelConfig) -> bool:
    """Whether the C decoder (decode step and prefill) runs this model (multi-head latent
    attention included: runtime/src/mla_step.c; llama4's chunked / NoPE attention and
    input-weighted experts: runtime/src/llama4.c): not a model with Gated DeltaNet layers
    (qwen35moe), which the C core does not implement. Such a model runs the reference forward
    with the C core's `linear` for every matrix and its routed-expert kernel (the DeltaNet
    recurrence, conv, norms and attention in torch: per token a few small ops per layer against
    the experts' and matrices' memory reads)."""
    return not any(cfg.recurrent_layers)


class CpuExecutor(ReferenceModel):
    """Forward pass on the CPU. `forward` returns float32 logits [n_tokens, n_vocab]."""

    def __init__(self, cfg: ModelConfig, weights: HostWeights) -> None:
        super().__init__(cfg, weights)
        # The C core when routed experts run on it: then the dense matrices run on it too, and a
        # one-token forward is one C call per token (CpuDecoder).
        self.core: CpuCore | None = None
        self._decoder: CpuDecoder | None = None
        self.file: GGUFFile | None = None  # the mapped file, for prefetch hints
        self.ubatch: int | None = None  # prefill tokens per chunk (None: the C core's default)
        self.sparse_decode = True  # decode steps skip neurons as expert_threshold says
        self.sparse_layers: list[bool] | None = None  # ... in these layers (None: in all)
        self._deltanet_c: CDeltaNet | None = None  # DeltaNet decode steps on the C core
        self._gate_copies: dict[int, np.ndarray] = {}  # per MoE layer, its gate rows apart
        self.gate_copy_bytes = 0  # bytes of those copies (0: none)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Start paging the experts' bytes in from the file (readahead), without waiting."""
        if self.file is not None:
            for e in experts:
                self.file.advise_willneed(self.weights.expert(layer, e).data)

    @classmethod
    def from_gguf(
        cls,
        f: GGUFFile,
        threads: int | None = None,
        expert_backend: str = "auto",
        ubatch: int | None = None,
    ) -> CpuExecutor:
        """expert_backend: 'auto' (C core when built), 'c' or 'torch' (the reference); ubatch:
        prefill tokens per chunk on the C core (None: its default)."""
        if ubatch is not None and ubatch < 1:
            raise UsageError(f"--ubatch must be >= 1, got {ubatch}")
        if threads is not None:
            if threads < 1:
                raise UsageError(f"--threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        cfg = ModelConfig.from_gguf(f)
        model = cls(cfg, HostWeights.from_gguf(f, cfg))
        model.file = f
        model.ubatch = ubatch
        model.expert_backend = make_expert_backend(expert_backend, threads)
        core = getattr(model.expert_backend, "core", None)
        if core is not None:
            model.use_core(core)
        return model

    def use_core(self, core: CpuCore) -> None:
        """Run forward passes (and the reference path's dense matrices) on `core`."""
        self.core = core
        self.linear = self._core_linear
        self.heads_linear = self._core_heads_linear
        if not c_decoder_runs(self.config):
            # a DeltaNet layer's decode step as one C call (the prompt: the chunked torch form)
            self._deltanet_c = CDeltaNet(self.config, self.weights, core)
            torch.set_num_threads(1)  # as below: the pool's threads do the heavy parts
            return
        self._decoder = CpuDecoder(self.config, self.weights, core)
        # One thread pool for everything: torch only runs the few ops left on the prefill path
        # (attention, norms), and its threads would otherwise compete with the pool's.
        torch.set_num_threads(1)

    def use_gate_copy(self, mode: str, model_bytes: int) -> None:
        """Copy the routed experts' gate rows apart for the sparse decode steps (mode on, or
        auto: when expert_threshold is set and the copy fits in RAM beside the model file of
        model_bytes; pyruntime.experts.gates) and describe the model to the C decoder again with
        them. Call before choose_decode_sparsity, which then measures with them. No-op without
        the C decoder."""
        if self._decoder is None:
            return
        layers = {i: blk.experts for i, blk in enumerate(self.weights.blocks)
                  if blk.experts is not None}  # fmt: skip
        sparse = self.expert_threshold is not None
        if not gates.decide(mode, sparse, list(layers.values()), model_bytes,
                            gates.mem_available()):  # fmt: skip
            return
        self._set_gate_copies({i: gates.gates_apart(store) for i, store in layers.items()})

    def _set_gate_copies(self, copies: dict[int, np.ndarray]) -> None:
        """A C decoder reading these layers' gate copies (the old decoder and the copies it
        alone held are freed)."""
        self._decoder = CpuDecoder(self.config, self.weights, self.core, gates=copies)
        self._gate_copies = copies
        self.gate_copy_bytes = sum(c.nbytes for c in copies.values())

    def choose_decode_sparsity(self, key: str, cache_dir: Path, timer=None) -> None:
        """Which layers decode steps run with their expert_threshold and which dense: whichever
        decoded faster on this machine and pool, per layer, where the mix beats dense steps
        (pyruntime.cpu.sparse_switch; measured once per key, thresholds and thread count,
        cached in cache_dir; one line on stderr before a measurement). Prefill keeps the
        thresholds. Without the C core or thresholds: sparse as expert_threshold says."""
        self.sparse_decode, self.sparse_layers = True, None
        if self._decoder is None or self.expert_threshold is None:
            return

        def tell(path: Path) -> None:
            print(f"pyruntime: timing dense vs sparse decode steps per layer on "
                  f"{self.core.threads} CPU threads (once per model, sparsity and thread count; "
                  f"cached in {path.parent})", file=sys.stderr, flush=True)  # fmt: skip

        self.sparse_layers = sparse_switch.sparse_layers(
            self, self.expert_threshold, key, cache_dir, on_measure=tell,
            **({} if timer is None else {"timer": timer}),
        )  # fmt: skip
        self.sparse_decode = any(self.sparse_layers)
        self.stats.reset()  # the measurement's own steps
        kept = {i: c for i, c in self._gate_copies.items() if self.sparse_layers[i]}
        if len(kept) < len(self._gate_copies):  # a dense layer never reads its copy: freed
            self._set_gate_copies(kept)

    def decode_thresholds(self) -> list[float | None] | None:
        """The thresholds decode steps run with (None: dense), per choose_decode_sparsity."""
        if not self.sparse_decode or self.expert_threshold is None:
            return None
        if self.sparse_layers is None:
            return self.expert_threshold
        return sparse_switch.mixed(self.expert_threshold, self.sparse_layers)

    def _deltanet(self, i: int, blk, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A Gated DeltaNet layer: one token on the C core (pyrt_deltanet_step), else the
        reference's torch forms."""
        if self._deltanet_c is None or x.shape[0] != 1:
            return super()._deltanet(i, blk, x, cache)
        state = cache.recurrent
        return self._deltanet_c.step(i, x, state.conv[i], state.ssm[i])

    def _core_heads_linear(self, x: torch.Tensor, w: QuantMatrix) -> torch.Tensor:
        """x [H, 1, n_in] through w's H blocks of rows in one C call (pyrt_linear_heads); more
        than one token per head: one call per head."""
        if x.shape[1] != 1:
            return heads_linear(self._core_linear)(x, w)
        y = self.core.linear_heads(w.raw, int(w.qtype), w.shape[0], w.shape[1], x[:, 0])
        return y[:, None]

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
            k = check_k(k, self.config)
            token = single_token(tokens, self.config.n_vocab)
            if token is not None:  # decode: one C call, no torch op (~15 us of Python)
                return self._decode(token, cache, k, routing)
            return self._prefill(token_ids(tokens, self.config.n_vocab), cache, last_only, k,
                                 routing)  # fmt: skip
        return self._forward_torch(tokens, cache, last_only, k, routing)

    def _decoder_k(self, k: int) -> int | None:
        """k for a C call: None (the plain call) when it is the decoder's own model's top-k."""
        return None if k == self._decoder.config.n_expert_used else k

    def _routing_outputs(self, k: int, routing: RoutingTrace | None):
        """(route_ids, route_logits) tensors for a C call to fill, or (None, None)."""
        if routing is None:
            return None, None
        cfg = self.config
        return (torch.empty((cfg.n_layer, k), dtype=torch.int32),
                torch.empty((cfg.n_layer, cfg.n_expert), dtype=torch.float32))  # fmt: skip

    def _fill_routing(self, routing: RoutingTrace | None, ids, logits) -> None:
        if routing is not None:
            layers = self.moe_layers()
            routing.layers = layers
            routing.ids = ids[layers].long() if layers else None
            routing.logits = logits[layers] if layers else None

    def _prefill(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        last_only: bool,
        k: int,
        routing: RoutingTrace | None,
    ) -> torch.Tensor:
        """Several tokens through the C prefill; logits [n, n_vocab] ([1, n_vocab] last_only)."""
        self.stats.begin("prefill")
        cache.reserve(ids.numel())
        cfg = self.config
        route_ids, route_logits = self._routing_outputs(k, routing)
        out, n_active = self._decoder.prefill(
            ids,
            cache,
            self.expert_threshold,
            all_logits=not last_only,
            ubatch=self.ubatch,
            k=self._decoder_k(k),
            route_ids=route_ids,
            route_logits=route_logits,
        )
        self.stats.add(n_pairs=self._decoder.n_pairs, n_active=n_active, n_ff=cfg.n_ff_exp)
        self._fill_routing(routing, route_ids, route_logits)
        return out

    def _decode(
        self, token: int, cache: KVCache, k: int, routing: RoutingTrace | None
    ) -> torch.Tensor:
        """One token through the C decode step; logits [1, n_vocab]."""
        self.stats.begin("decode")
        cache.reserve(1)
        cfg = self.config
        ids, logits = self._routing_outputs(k, routing)
        out, n_active = self._decoder.step(
            token,
            cache,
            self.decode_thresholds(),
            k=self._decoder_k(k),
            route_ids=ids,
            route_logits=logits,
        )
        self.stats.add(n_pairs=self._decoder.n_pairs, n_active=n_active, n_ff=cfg.n_ff_exp)
        self._fill_routing(routing, ids, logits)
        return out

    def decode_times(self, reset: bool = False) -> dict[str, float]:
        """Seconds of the C decode steps by part (CpuDecoder.times); {} without the C core."""
        return {} if self._decoder is None else self._decoder.times(reset)
