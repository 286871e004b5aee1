"""The GPU executor: the model on one torch device (a GPU; the CPU under the Triton interpreter
for tests), on the shared model description (pyruntime.model).

Same math as pyruntime.model.reference, laid out for a GPU:
- weights uploaded once from the host description (pyruntime.gpu.weights): routed experts in
  their GGUF format (dense or neuron-sparse kernels under a per-layer threshold, the path from
  kernels.expert_paths), Q8_0 matmul weights kept Q8_0 (Q4_0 ones repacked to Q8_0, exact),
  other dense weights float32 for an F32 GGUF (so logits match the CPU path) else bfloat16;
- the shared KVCache, fixed-size on the device (new_cache); what the GPU derives from it
  (step inputs, rope tables, captured graphs) lives in its executor_state
  (pyruntime.gpu.cache_state);
- Gated DeltaNet layers (qwen35moe) read and write the cache's recurrent state in place
  (kernels.deltanet: one decode kernel; gpu/deltanet.py: the chunked kernels for a prompt);
  multi-head latent attention layers (deepseek2) their cache's one plane of latents (gpu/mla.py);
- llama4: chunked attention (a window aligned to chunk boundaries, in the decode kernel and the
  prefill mask), NoPE layers (no rope, temperature-scaled queries in the rope/KV-store kernel),
  q/k L2 norm, top-k by logit weighted sigmoid(logit) on the expert's input (layers.route and
  layers.routed_experts);
- a step is the per-layer pieces of pyruntime.gpu.layers in a loop. Prefill (n > 1 tokens) runs
  eagerly (GEMM kernels, torch SDPA; docs/architecture.md), and on CUDA a prompt shape that comes
  again is captured in a CUDA graph (_captured_prefill); decode (1 token) reads its inputs
  (token id, position, cached length) from device tensors, so on CUDA it is captured once per
  (cache, k, expert maps) in a CUDA graph and replayed for every token.

The residual stream is float32 whatever the weight dtype; norm outputs are cast to the
activation dtype (f32 or bf16) for the matmuls; routers and the shared-expert gate run in float32
(they are F32 in the GGUF). Per layer, a decode step is 6 launches plus the experts': residual
add + RMSNorm, qkv GEMV, q/k-norm + rope + KV-store, attention (one launch, kernels.grid_sync
merges its splits), o_proj, and one launch for the residual add + RMSNorm + router GEMV +
softmax + top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pyruntime.errors import UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.gpu import cache_state
from pyruntime.gpu.cache_state import STATE_KEY, CapturedPrefill, CapturedStep, GpuCacheState
from pyruntime.gpu.layers import DecoderLayers, Routed, Span
from pyruntime.gpu.weights import (
    DeviceBlock,
    Linear,
    dense_dtype_for,
    first_matrix_type,
    upload_weights,
)
from pyruntime.kernels import tuning
from pyruntime.kernels.expert_formats import activation_issue
from pyruntime.kernels.expert_paths import SPARSE_PATHS, expert_path
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.reference import check_k
from pyruntime.model.stats import ExpertStats
from pyruntime.model.tokens import single_token, token_ids
from pyruntime.model.weights import HostWeights

ExpertMaps = Sequence[torch.Tensor | None]  # per layer: int32 [n_expert] expert -> slot, or None


class GpuExecutor:
    """Forward pass on `device`; `forward` returns float32 logits [n_tokens, n_vocab] on the
    host (the sampler's side).

    kernel_tuning: a launch-config file of bench/gpu_kernels.py (kernels.tuning), installed for
    the process. On a CUDA device decode steps are captured in CUDA graphs (cuda_graphs);
    decode_step_eager runs one eagerly, for profiling."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: HostWeights,
        device: str | torch.device = "cuda",
        *,
        kernel_tuning: str | Path | None = None,
    ) -> None:
        self.config = cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        issue = activation_issue(cfg.activation, (cfg.swiglu_alpha, cfg.swiglu_limit))
        if issue is not None:
            raise UsageError(f"{issue}; use --device cpu")
        try:  # a bad tuning file: one line now, not a traceback mid-decode
            tuning.set_overrides(None if kernel_tuning is None else tuning.load(kernel_tuning))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.dtype = dense_dtype_for(first_matrix_type(weights))
        self.weights = upload_weights(weights, cfg, self.device, self.dtype)
        self.layers = DecoderLayers(cfg, self.weights, self.dtype)
        self.stats = ExpertStats(self.device)
        self.cuda_graphs = self.device.type == "cuda"
        self._moe_layers = [i for i, b in enumerate(self.weights.blocks) if b.experts is not None]
        self._version = 0  # bumped when captured graphs and step counts go stale
        self._pair_counts: dict[tuple, tuple[int, int]] = {}

    @classmethod
    def from_gguf(cls, f: GGUFFile, device: str | torch.device = "cuda", **options) -> GpuExecutor:
        cfg = ModelConfig.from_gguf(f)
        return cls(cfg, HostWeights.from_gguf(f, cfg), device, **options)

    @property
    def blocks(self) -> list[DeviceBlock]:
        return self.weights.blocks

    @property
    def output(self) -> Linear:
        return self.weights.output

    @property
    def profile_parts(self) -> bool:
        """Label the pieces of each layer for torch.profiler (bench/gpu_decode.py)."""
        return self.layers.profile_parts

    @profile_parts.setter
    def profile_parts(self, on: bool) -> None:
        self.layers.profile_parts = on

    def moe_layers(self) -> list[int]:
        """Indices of the layers with routed experts (the others have a dense FFN)."""
        return list(self._moe_layers)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Nothing to do: every routed expert is in device memory."""

    def new_cache(self, max_tokens: int) -> KVCache:
        """A KV cache on the device, its storage fixed for its life (captured graphs read it)."""
        return KVCache(self.config, max_tokens, self.device, self.dtype, growable=False)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- neuron sparsity ----------------------------------------------------------------------

    def set_expert_threshold(self, thresholds: Sequence[float] | None, key: str = "",
                             cache_dir: Path | None = None) -> None:  # fmt: skip
        """Per-layer |act(gate)| thresholds (None = dense); see DecoderLayers.set_sparsity (on
        CUDA with a `key`, each layer's dense/sparse switch is profiled, cached in cache_dir).
        Captured decode graphs are recaptured on their next step."""
        self.layers.set_sparsity(thresholds, key if self.device.type == "cuda" else "", cache_dir)
        self._version += 1
        self._pair_counts.clear()

    def _sparse_at(self, i: int, n_tok: int) -> bool:
        """Whether layer i's routed experts take a sparse path at n_tok tokens (moe_experts'
        decision, from kernels.expert_paths)."""
        if self.layers.expert_threshold is None:
            return False
        blk = self.blocks[i]
        path = expert_path(blk.experts_fmt, self.config.n_embd, n_tok,
                           self.layers.sparse_switch[i])  # fmt: skip
        return path in SPARSE_PATHS

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
        *,
        k: int | None = None,
        routing: RoutingTrace | None = None,
        expert_maps: ExpertMaps | None = None,
    ) -> torch.Tensor:
        """Logits float32 [n_tokens, n_vocab] on the host (or [1, n_vocab] with last_only) of
        `tokens` at positions cache.n_tokens.., which the cache then holds.

        k: experts per token (1..n_expert; None: the model's n_expert_used); routing: filled
        with each MoE layer's top-k ids and router logits of the last token (copied to the host
        only when asked); expert_maps: per layer an int32 [n_expert] map expert -> slot of the
        layer's expert tensor, -1 for experts this call does not compute (their pairs add
        nothing; kernels.moe_args), or None. A decode step's graph is captured per (k, maps):
        update a map's values in place rather than passing a new tensor each step."""
        k = check_k(k, self.config)
        maps = self._check_maps(expert_maps)
        token = single_token(tokens, self.config.n_vocab)
        self.stats.begin("decode" if token is not None else "prefill")
        if token is not None:
            return self._decode(token, cache, k, routing, maps)
        return self._prefill(tokens, cache, last_only, k, routing, maps)

    def span(self, tokens: Sequence[int] | torch.Tensor, cache: KVCache) -> Span:
        """Where `tokens` go in `cache` (its next positions), for running the per-layer pieces
        (self.layers) by hand as forward() does: makes room and, for one token, writes the
        decode step's device inputs. The caller adds span.n to cache.n_tokens when done."""
        state = self._state(cache)
        token = single_token(tokens, self.config.n_vocab)
        if token is not None:
            cache.reserve(1)
            state.set_step(token, cache.n_tokens)
            return self._decode_span(state)
        ids = token_ids(tokens, self.config.n_vocab)
        cache.reserve(ids.numel())
        start = cache.n_tokens
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        return Span(ids.to(self.device), positions, state.cos, state.sin, start=start)

    def _decode_span(self, state: GpuCacheState) -> Span:
        return Span(state.token, state.position, state.cos, state.sin, seq_len=state.seq_len)

    def _check_maps(self, maps: ExpertMaps | None) -> tuple | None:
        if maps is None:
            return None
        maps = tuple(maps)
        cfg = self.config
        if len(maps) != cfg.n_layer:
            raise UsageError(f"expert_maps needs one entry per layer ({cfg.n_layer}), got "
                             f"{len(maps)}")  # fmt: skip
        for i, m in enumerate(maps):
            if m is None:
                continue
            if self.blocks[i].experts is None:
                raise UsageError(f"layer {i} has no routed experts: its expert map must be None")
            if m.dtype != torch.int32 or m.shape != (cfg.n_expert,) or m.device != self.device:
                raise UsageError(
                    f"expert map of layer {i} must be int32 [{cfg.n_expert}] on {self.device}, "
                    f"got {m.dtype} {list(m.shape)} on {m.device}"
                )
        return maps

    def _state(self, cache: KVCache) -> GpuCacheState:
        """This executor's state of `cache`, made on first use."""
        state = cache.executor_state.get(STATE_KEY)
        if state is None or state.owner_id != id(self):  # none yet, or another executor's
            if cache.growable or cache.device != self.device or cache.dtype != self.dtype:
                raise UsageError(
                    f"this KV cache ({cache.dtype} on {cache.device}, growable={cache.growable}) "
                    "was not made by this executor: use its new_cache()"
                )
            with torch.inference_mode(False):  # the step inputs are rewritten outside it
                state = GpuCacheState(self, self.config, cache.max_tokens, self.device)
            cache.executor_state[STATE_KEY] = state
        return state

    # -- prefill (eager) ----------------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, tokens, cache: KVCache, last_only: bool, k: int,
                 routing: RoutingTrace | None, maps: tuple | None) -> torch.Tensor:  # fmt: skip
        span = self.span(tokens, cache)
        if self.cuda_graphs:
            logits, routes = self._captured_prefill(span, cache, k, maps, last_only)
        else:
            logits, routes = self._step(span, cache, k, maps, True, last_only)
        cache.end_pass(cache.n_tokens + span.n, span.n)
        if routing is not None:
            self._trace(routing, routes, k)
        return logits.float().cpu()

    def _captured_prefill(self, span: Span, cache: KVCache, k: int, maps: tuple | None,
                          last_only: bool):  # fmt: skip
        """(logits, routes) of a prompt pass, from a CUDA graph of its shape where one is kept.

        The eager pass is host-bound: olmoe-1b-7b's 512 tokens launch 276 kernels, 15-21 ms of
        Python and launch time against 10.8 ms of GPU work on an H100, and the host's pace
        differs from process to process (pp512 25-45k tok/s); a replay takes the kernels' time
        in every process. A shape (tokens, first position, k, last_only, expert maps) is
        captured the second time it comes on this cache (the bench's repetitions; not
        perplexity's windows, each on a fresh cache), so a one-off prompt (a chat turn) never
        pays a capture; a replay reads the new token ids from the captured span's tensor."""
        state = self._state(cache)
        key = (span.n, span.start, k, last_only, self._maps_key(maps))
        step = state.prefills.get(key)
        if step is None or step.version != self._version:
            if step is None and not state.seen_before(key):
                return self._step(span, cache, k, maps, True, last_only)
            graph, outputs = self._capture(cache, lambda: self._step(span, cache, k, maps, False,
                                                                     last_only))  # fmt: skip
            step = CapturedPrefill(graph, outputs, self._version, span.ids)
            state.keep_prefill(key, step)
        else:
            state.prefills.move_to_end(key)
            step.ids.copy_(span.ids)
        self._count_pairs(k, maps, span.n)
        step.graph.replay()
        return step.outputs

    def _capture(self, cache: KVCache, fn):
        """(graph, outputs) of fn captured, its warm-up run undone: the device counts restored
        (a replay adds them) and a recurrent state (DeltaNet layers), which it advanced."""
        saved = self.stats.device_snapshot()
        recurrent = None if cache.recurrent is None else cache.recurrent.copy()
        with torch.inference_mode():
            graph, outputs = cache_state.capture(fn, self.device)
        self.stats.device_restore(saved)
        if recurrent is not None:
            cache.recurrent.load(recurrent)
        return graph, outputs

    @staticmethod
    def _maps_key(maps: tuple | None) -> tuple | None:
        """Expert maps by address: a graph reads the map tensors it was captured with."""
        return None if maps is None else tuple(None if m is None else m.data_ptr() for m in maps)

    # -- decode (one token; captured in a CUDA graph) -----------------------------------------

    def _decode(self, token: int, cache: KVCache, k: int, routing: RoutingTrace | None,
                maps: tuple | None) -> torch.Tensor:  # fmt: skip
        """Logits [1, n_vocab] f32 on the host of one token at position cache.n_tokens. With
        graphs, the host per token only writes the step inputs, replays and copies the logits
        back, outside torch.inference_mode (tens of us per call at batch 1, when the whole GPU
        step is ~1 ms)."""
        state = self._state(cache)
        cache.reserve(1)
        state.set_step(token, cache.n_tokens)
        self._count_pairs(k, maps, 1)
        if self.cuda_graphs:
            logits, routes = self._captured_step(state, cache, k, maps)
        else:
            with torch.inference_mode():
                logits, routes = self._step(self._decode_span(state), cache, k, maps, False)
        cache.n_tokens += 1
        # Through pinned memory (torch's caching host allocator reuses the block once the caller
        # drops it): a direct copy, not pageable memory's staged one (~8 GB/s here). A copy in
        # any case: a captured step's logits are rewritten by the next replay.
        pinned = logits.is_cuda
        out = torch.empty(logits.shape, dtype=torch.float32, pin_memory=pinned)
        out.copy_(logits, non_blocking=pinned)
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
        if routing is not None:
            self._trace(routing, routes, k)
        return out

    def _captured_step(self, state: GpuCacheState, cache: KVCache, k: int, maps: tuple | None):
        """Replay the decode graph of (k, maps) on the step inputs, capturing it first when
        there is none or the model state changed since. Returns its (logits, routes)."""
        key = (k, self._maps_key(maps))
        step = state.graphs.get(key)
        if step is None or step.version != self._version:
            graph, outputs = self._capture(
                cache, lambda: self._step(self._decode_span(state), cache, k, maps, False)
            )
            step = state.graphs[key] = CapturedStep(graph, outputs, self._version)
        step.graph.replay()
        return step.outputs

    def decode_graph(self, cache: KVCache, k: int | None = None):
        """The CUDA graph of the decode step captured on `cache` for k (no expert maps), or
        None (bench/gpu_decode.py replays it to time the GPU side of a step)."""
        state = cache.executor_state.get(STATE_KEY)
        if state is None or state.owner_id != id(self):
            return None
        step = state.graphs.get((check_k(k, self.config), None))
        return None if step is None else step.graph

    @torch.inference_mode()
    def decode_step_eager(self, cache: KVCache, k: int | None = None) -> torch.Tensor:
        """One decode step run eagerly on the inputs last written to `cache`'s step state (the
        cache does not advance): logits [1, n_vocab] on the device (for profiling)."""
        k = check_k(k, self.config)
        logits, _ = self._step(self._decode_span(self._state(cache)), cache, k, None, False)
        return logits

    def _count_pairs(self, k: int, maps: tuple | None, n_tok: int) -> None:
        """Host-side counts of a captured pass's routed work over n_tok tokens (a replay cannot
        run Python; _count's host part): the pairs of dense and sparse layers without an expert
        map, counted once per (model state, k, n_tok, which layers have maps); the rest is
        counted on the device inside the pass."""
        key = (k, n_tok, None if maps is None else tuple(m is not None for m in maps))
        counts = self._pair_counts.get(key)
        if counts is None:
            n_dense = n_sparse = 0
            for i in self._moe_layers:
                if maps is None or maps[i] is None:
                    if self._sparse_at(i, n_tok):
                        n_sparse += k * n_tok
                    else:
                        n_dense += k * n_tok
            counts = self._pair_counts[key] = (n_dense, n_sparse)
        n_dense, n_sparse = counts
        n_ff = self.config.n_ff_exp
        if n_dense:
            self.stats.add(n_dense, n_dense * n_ff, n_ff)
        if n_sparse:
            self.stats.add_pairs(n_sparse, n_ff)

    # -- a step: the per-layer pieces in a loop -----------------------------------------------

    def _step(self, span: Span, cache: KVCache, k: int, maps: tuple | None, count_host: bool,
              last_only: bool = False):  # fmt: skip
        """(logits [n or 1, n_vocab] f32 on the device, [(ids [n, k], router logits [n, E])]
        per MoE layer) of span's tokens, whose K/V it writes into cache. No host sync: a decode
        step is captured as is. count_host: count the routed pairs here (prefill; decode counts
        them in _count_pairs)."""
        layers = self.layers
        x = layers.embed(span.ids)
        delta = None
        routes = []
        for i, blk in enumerate(self.blocks):
            x, delta = layers.mixer(i, x, delta, cache, span)
            if blk.experts is None:
                x, h, _ = layers.ffn_norm(i, x, delta)
                delta = layers.dense_ffn(i, h)
                continue
            r = layers.route(i, x, delta, k)
            emap = None if maps is None else maps[i]
            y, active = layers.routed_experts(i, r, emap)
            self._count(r, active, emap, count_host)
            delta = layers.ffn_output(i, r, y)
            x = r.x
            routes.append((r.ids, r.logits))
        self.stats.flush()  # the device counts of the step (inside a captured step too)
        if last_only:
            x, delta = x[-1:], delta[-1:]
        return layers.output(x, delta), routes

    def _count(self, r: Routed, active: torch.Tensor | None, emap: torch.Tensor | None,
               count_host: bool) -> None:  # fmt: skip
        """Expert stats of one MoE layer: active counts on the device where a kernel made them;
        with an expert map, which pairs were computed here too (known on the device only: one
        gather a layer, the rest summed once a step by stats.flush)."""
        n_ff = self.config.n_ff_exp
        if emap is not None:
            self.stats.add_device(active, emap[r.ids], n_ff)
        elif active is not None:
            self.stats.add_device(active)
            if count_host:
                self.stats.add_pairs(r.ids.numel(), n_ff)
        elif count_host:
            self.stats.add(r.ids.numel(), r.ids.numel() * n_ff, n_ff)

    def _trace(self, trace: RoutingTrace, routes: list, k: int) -> None:
        """Fill `trace` with the last token's routing of each MoE layer (one copy to the host)."""
        trace.layers = self.moe_layers()
        if not routes:
            trace.ids = torch.zeros(0, k, dtype=torch.int64)
            trace.logits = torch.zeros(0, self.config.n_expert)
            return
        trace.ids = torch.stack([ids[-1] for ids, _ in routes]).cpu()
        trace.logits = torch.stack([logits[-1] for _, logits in routes]).float().cpu()
