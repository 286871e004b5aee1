"""The whole model on the C core: one decode step, or a prefill of many tokens, in one C call
(runtime/src/decode.c pyrt_decoder_step, runtime/src/prefill.c pyrt_decoder_prefill).

`CpuDecoder` describes the model's host weights to the C core once (pyruntime.cpu.model_desc:
pointers into the GGUF mmap for every weight matrix, read in place in its stored format, and the
small F32 tensors with their lengths). A step then runs embedding, every block (attention with
the KV cache, router, routed experts, shared expert or dense FFN) and the output matrix on the
core's thread pool, without a torch op or a return to Python in between; a prefill does the same
for many tokens, chunk by chunk (each chunk's tokens through every layer together: batched
matrix products, each routed expert once per chunk, the chunk's attention over the cache).

What a call can do beyond the model's defaults (the seams offloading and big/little use):
- k: experts per token for this call (1..n_expert; the chosen k are renormalized as the model
  says), default the model's n_expert_used;
- route_ids / route_logits: every layer's chosen experts and router logits (of the last token),
  written into tensors the caller owns (no work when not asked);
- expert_maps: per layer, which experts are computed here (the rest elsewhere, e.g. on a GPU);
- the step in pieces: begin(), attention(i), ffn(i) per layer, end(), with read_x() / write_x()
  on the residual stream between them (the same bits as step()).

The KV cache is the model's KVCache ([n_head_kv, capacity, head_dim] per layer, read and written
in place); its pointers are kept in the cache's executor_state, which the cache clears when its
storage moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.call_args import CallArgs
from pyruntime.cpu.model_desc import ModelDescription
from pyruntime.model.config import ModelConfig
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.weights import HostWeights


class CpuDecoder:
    """Owner of a C decoder (pyrt_decoder) for one model on one CpuCore; freed with the object."""

    def __init__(self, cfg: ModelConfig, weights: HostWeights, core: cpu_core.CpuCore,
                 gates: dict[int, np.ndarray] | None = None) -> None:  # fmt: skip
        """gates: None, or the MoE layers' gate rows apart ({layer: [n_expert, n_ff, row_bytes]},
        pyruntime.experts.gates), which sparse decode steps read; dense steps and prefill read
        the file's."""
        self._ffi = ffi = cpu_core._ffi
        self._lib = lib = cpu_core._lib()
        self.config = cfg
        self.core = core
        self._model = ModelDescription(cfg, weights, gates)  # borrowed by the C decoder
        out = ffi.new("pyrt_decoder **")
        cpu_core._check(lib.pyrt_decoder_create(self._model.weights, out), "pyrt_decoder_create")
        self._dec = ffi.gc(out[0], lib.pyrt_decoder_free)
        self.n_moe_layers = sum(blk.experts is not None for blk in weights.blocks)
        self._step = CallArgs(cfg, "pyrt_step_args")  # one step's arguments, reused
        self._args = self._step.args
        self._prefill = CallArgs(cfg, "pyrt_prefill_args")
        self.n_pairs = 0  # (token, expert) pairs the last call computed

    # ---- the step ----------------------------------------------------------------------------

    def _prepare(
        self,
        token: int,
        cache: KVCache,
        thresholds: list[float] | None,
        k: int | None,
        route_ids: torch.Tensor | None,
        route_logits: torch.Tensor | None,
        expert_maps: Sequence[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        """Fills the step's pyrt_step_args for `token` at position cache.n_tokens; returns the
        logits tensor [1, n_vocab] it will write."""
        self._step.bind(cache, thresholds, k, route_ids, route_logits, expert_maps)
        logits = torch.empty((1, self.config.n_vocab), dtype=torch.float32)
        self._args.token, self._args.pos = token, cache.n_tokens
        self._step.set_logits(logits)
        return logits

    def step(
        self,
        token: int,
        cache: KVCache,
        thresholds: list[float] | None = None,
        *,
        k: int | None = None,
        route_ids: torch.Tensor | None = None,
        route_logits: torch.Tensor | None = None,
        expert_maps: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """(logits [1, n_vocab] float32, routed neurons computed) after `token` at position
        cache.n_tokens; advances the cache by one position. The caller has reserved room for it
        (KVCache.reserve).

        thresholds: per-layer sparsity thresholds, or None (dense).
        k: experts per token for this step, 1..n_expert (None: the model's n_expert_used).
        route_ids: None, or an int32 tensor [n_layer, k] that receives each MoE layer's chosen
            experts in order of routing weight (-1 rows for dense-FFN layers).
        route_logits: None, or a float32 tensor [n_layer, n_expert] that receives each MoE
            layer's router logits before the softmax (NaN rows for dense-FFN layers).
        expert_maps: None, or one entry per layer: None (every expert computed here) or an int
            tensor [n_expert], expert id -> itself if computed here, -1 if computed elsewhere
            (its pairs are skipped; the caller adds their share to the residual stream, see the
            per-layer calls). Dense-FFN layers ignore theirs.
        After the step, self.n_pairs holds the (token, expert) pairs it computed."""
        logits = self._prepare(token, cache, thresholds, k, route_ids, route_logits, expert_maps)
        cpu_core._check(
            self._lib.pyrt_decoder_step(self._dec, self.core._pool, self._args),
            "pyrt_decoder_step",
        )
        cache.n_tokens += 1
        self.n_pairs = int(self._args.n_pairs)
        return logits, int(self._args.n_active)

    # ---- prefill -----------------------------------------------------------------------------

    def prefill(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        thresholds: list[float] | None = None,
        *,
        all_logits: bool = False,
        ubatch: int | None = None,
        k: int | None = None,
        route_ids: torch.Tensor | None = None,
        route_logits: torch.Tensor | None = None,
        expert_maps: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """(logits, routed neurons computed) of `tokens` (int, 1-D, in range) at positions
        cache.n_tokens.., in one C call: [n, n_vocab] with all_logits, else the last token's
        [1, n_vocab]; advances the cache by n positions (room reserved by the caller).

        ubatch: tokens per chunk (None: the C core's default). thresholds, k, expert_maps: as
        step(), for every token; route_ids / route_logits: as step(), of the last token.
        After the call, self.n_pairs holds the (token, expert) pairs it computed."""
        cfg = self.config
        ids = cpu_core._as_cpu(tokens, torch.int32, "tokens", 1)
        n = ids.shape[0]
        self._prefill.bind(cache, thresholds, k, route_ids, route_logits, expert_maps)
        logits = torch.empty((n if all_logits else 1, cfg.n_vocab), dtype=torch.float32)
        a = self._prefill.args
        a.tokens = self._ffi.cast("const int32_t *", ids.data_ptr())
        a.n_tokens, a.pos = n, cache.n_tokens
        a.ubatch = 0 if ubatch is None else ubatch
        a.all_logits = int(all_logits)
        self._prefill.set_logits(logits)
        cpu_core._check(
            self._lib.pyrt_decoder_prefill(self._dec, self.core._pool, a), "pyrt_decoder_prefill"
        )
        cache.n_tokens += n
        self.n_pairs = int(a.n_pairs)
        return logits, int(a.n_active)

    # ---- the step in pieces ------------------------------------------------------------------

    def begin(
        self,
        token: int,
        cache: KVCache,
        thresholds: list[float] | None = None,
        *,
        k: int | None = None,
        route_ids: torch.Tensor | None = None,
        route_logits: torch.Tensor | None = None,
        expert_maps: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Starts a step in pieces (arguments as step()): the residual stream x becomes the
        embedding of `token`. Then attention(i) and ffn(i) for every layer i in order, then end();
        read_x() / write_x() in between hand the residual stream to other hardware and back."""
        self._logits = self._prepare(
            token, cache, thresholds, k, route_ids, route_logits, expert_maps
        )
        self._cache = cache
        cpu_core._check(
            self._lib.pyrt_decoder_begin(self._dec, self.core._pool, self._args),
            "pyrt_decoder_begin",
        )

    def attention(self, layer: int) -> None:
        """x += the attention half of block `layer` (writes the token's k, v into the cache)."""
        cpu_core._check(
            self._lib.pyrt_decoder_attention(self._dec, self.core._pool, layer, self._args),
            "pyrt_decoder_attention",
        )

    def ffn(self, layer: int) -> None:
        """x += the FFN half of block `layer` (router, routed experts of its map, shared expert;
        or the dense FFN); fills that layer's rows of route_ids / route_logits."""
        cpu_core._check(
            self._lib.pyrt_decoder_ffn(self._dec, self.core._pool, layer, self._args),
            "pyrt_decoder_ffn",
        )

    def end(self) -> tuple[torch.Tensor, int]:
        """(logits [1, n_vocab], routed neurons computed) from x; advances the cache by one
        position, as step() does."""
        cpu_core._check(
            self._lib.pyrt_decoder_end(self._dec, self.core._pool, self._args),
            "pyrt_decoder_end",
        )
        self._cache.n_tokens += 1
        self.n_pairs = int(self._args.n_pairs)
        return self._logits, int(self._args.n_active)

    def read_x(self) -> torch.Tensor:
        """A copy of the residual stream x [n_embd] float32."""
        x = torch.empty(self.config.n_embd, dtype=torch.float32)
        cpu_core._check(
            self._lib.pyrt_decoder_read_x(self._dec, self._ffi.cast("float *", x.data_ptr())),
            "pyrt_decoder_read_x",
        )
        return x

    def write_x(self, x: torch.Tensor) -> None:
        """Sets the residual stream x [n_embd] (any float dtype; converted to float32)."""
        x = cpu_core._as_cpu(x, torch.float32, "x", 1)
        if x.shape != (self.config.n_embd,):
            raise cpu_core.CoreError(
                f"x has shape {tuple(x.shape)}, expected ({self.config.n_embd},)"
            )
        cpu_core._check(
            self._lib.pyrt_decoder_write_x(
                self._dec, self._ffi.cast("const float *", x.data_ptr())
            ),
            "pyrt_decoder_write_x",
        )

    def times(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent in the steps since the last reset: attention (with the embedding), ffn
        (router, routed and shared experts, dense FFN), output (final norm, output matrix), and
        the number of steps."""
        ns = self._ffi.new("int64_t[4]")
        cpu_core._check(self._lib.pyrt_decoder_times(self._dec, ns, int(reset)), "times")
        return {
            "attention": ns[0] * 1e-9,
            "ffn": ns[1] * 1e-9,
            "output": ns[2] * 1e-9,
            "steps": int(ns[3]),
        }
