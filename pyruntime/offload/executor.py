"""The hybrid executor: a model bigger than the GPU, its dense part and KV cache on the GPU, its
routed experts at home in host memory, a GPU cache of expert slots, misses computed on the CPU
or staged, whichever measured costs say is faster.

A forward pass runs pyruntime.gpu.layers' pieces one layer at a time on the device (attention,
route, the shared expert; dense-FFN layers whole), with each MoE layer's routed experts split
between the GPU's expert slots and the CPU by pyruntime.offload.split. Its parts:

- plan.py: the device budget (the dense part, the KV cache, the number of slots);
- embedding.py: an untied token embedding, left in host memory: the host writes the rows;
- home.py + host_register.py: the experts' host memory (the mapped GGUF, registered or through
  bounce buffers, or a pinned copy), which the CPU reads and the copies start from;
- segments.py: a decode step as CUDA graph segments between the MoE layers' expert placements;
- slots.py + streams.py: the slot tensor and its copies, ordered by events on a copy stream;
- cache.py + policy.py: which expert each slot holds, LRU or LFRU eviction;
- costs.py: where a miss is computed, from costs measured on this machine;
- stats.py: what it did.

With torch's CPU device standing in for the GPU (tests), every piece runs the same code, the
Triton kernels under the interpreter and the streams as no-ops.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pyruntime.cpu.core import CpuCore, physical_cores
from pyruntime.errors import DeviceMemoryError, PyruntimeWarning, UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.gguf.quant import FORMAT_NAMES
from pyruntime.gpu.cache_state import GpuCacheState
from pyruntime.gpu.layers import DecoderLayers, Routed, Span
from pyruntime.gpu.weights import dense_dtype_for, first_matrix_type, upload_weights
from pyruntime.kernels import tuning
from pyruntime.kernels.expert_formats import activation_issue
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.reference import check_k
from pyruntime.model.stats import ExpertStats
from pyruntime.model.tokens import single_token, token_ids
from pyruntime.model.weights import HostWeights
from pyruntime.offload.cache import ExpertCache
from pyruntime.offload.costs import Costs
from pyruntime.offload.embedding import HostEmbedding
from pyruntime.offload.home import default_pinning, open_home
from pyruntime.offload.host_register import Pinning
from pyruntime.offload.plan import gib
from pyruntime.offload.policy import make_policy
from pyruntime.offload.segments import DecodeSegments, HybridStep
from pyruntime.offload.slots import ExpertSlots
from pyruntime.offload.split import CpuWorker, SplitExperts
from pyruntime.offload.stats import OffloadStats, PartTimer
from pyruntime.offload.step_graph import StepGraph
from pyruntime.offload.streams import DeviceStreams

STATE_KEY = "hybrid"  # this executor's entry in KVCache.executor_state


class HybridExecutor:
    """Forward pass with the dense part on `device` and the routed experts in host memory
    (module doc); `forward` returns float32 logits on the host."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: HostWeights,
        device: str | torch.device,
        core: CpuCore,
        *,
        slots: int,
        costs: Costs | None = None,
        policy: str = "lfru",
        staging: str = "register",
        misses: str = "auto",
        lookahead: bool = False,
        cpu_thread: bool | None = None,
        staging_buffer: int | None = None,
        pinning: Pinning | None = None,
        kernel_tuning: str | Path | None = None,
        file: GGUFFile | None = None,
    ) -> None:
        """slots: GPU expert slots (the plan's); costs: the split's constants (needed with
        misses='auto' and slots > 0; measure_costs makes them); cpu_thread: the CPU's share
        on a worker thread always (True), never (False), or where the cost model says a layer
        finishes sooner so (None, with slots and a C pool of fewer threads than physical cores;
        pyruntime.offload.split); pinning: the
        host-memory locking seam (tests); file: the mapped GGUF, for readahead of unstaged
        prefetches."""
        self.config = cfg
        self.host = weights
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._moe = [i for i, b in enumerate(weights.blocks) if b.experts is not None]
        if not self._moe:
            raise UsageError("the hybrid executor needs a model with routed experts")
        issue = activation_issue(cfg.activation, (cfg.swiglu_alpha, cfg.swiglu_limit))
        if issue is not None:
            raise UsageError(f"{issue}; use --device cpu")
        stores = [weights.blocks[i].experts for i in self._moe]
        first = stores[0]
        if any((s.qtype, s.n_ff, s.n_embd) != (first.qtype, first.n_ff, first.n_embd)
               for s in stores):  # fmt: skip
            raise UsageError("the hybrid needs every layer's routed experts in one format and "
                             "shape (a slot holds an expert of any layer)")  # fmt: skip
        try:
            tuning.set_overrides(None if kernel_tuning is None else tuning.load(kernel_tuning))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.dtype = dense_dtype_for(first_matrix_type(weights))
        # An untied token embedding stays in host memory (pyruntime.offload.embedding); a tied
        # one is the lm_head, on the GPU.
        tied = weights.output is weights.token_embd
        self.embedding = None
        if not tied:
            self.embedding = HostEmbedding(weights.token_embd, cfg.embedding_scale, self.dtype)
        self.weights = upload_weights(weights, cfg, self.device, self.dtype,
                                      routed_experts=False, token_embd=tied)  # fmt: skip
        self.layers = DecoderLayers(cfg, self.weights, self.dtype)
        self.streams = DeviceStreams(self.device)
        self.slots = ExpertSlots(
            slots, first.n_ff, first.n_embd, FORMAT_NAMES[first.qtype], self.device,
            self.streams, staging_buffer or cfg.n_expert_used,
        )  # fmt: skip
        # Last of what can fail (device memory first), so a failure leaves nothing locked.
        self._pinning = pinning or default_pinning(self.device)
        self.home = open_home(weights, self.device, staging, self._pinning)
        self.cache = ExpertCache(cfg.n_layer, cfg.n_expert, slots, make_policy(policy))
        self.core = core
        self.file = file
        self.stats = ExpertStats(self.device)
        self.offload = OffloadStats()
        self.timer = PartTimer(self.streams.cuda)
        self.experts = SplitExperts(cfg, weights, self.layers, self.streams, self.home,
                                    self.slots, self.cache, core, self.stats, self.offload,
                                    self.timer)  # fmt: skip
        self.experts.lookahead = lookahead
        # None: the worker only where the C core's pool leaves a core free. A pool on every
        # core beside a busy worker (its C call) and this thread (queueing the GPU's share)
        # runs more threads than cores, and the pool's barriers then wait for a preempted
        # thread: on the device host (16 cores, -t 16, 16 transit slots) the CPU's share took
        # 50 ms a token on the worker against 10 ms inline.
        auto = cpu_thread is None and slots > 0 and core.threads < physical_cores()
        self.experts.worker = CpuWorker() if cpu_thread or auto else None
        self.experts.worker_always = bool(cpu_thread)
        # One CPU thread pool: the CPU's work is the C core's, and torch's few host ops (a
        # step's logits copy, the sampler's) would wake its OpenMP threads, which spin after
        # each op on the cores the C core's threads need (as the CPU executor does).
        torch.set_num_threads(1)
        self.set_misses(misses, costs)
        self._last_decode_end: float | None = None
        self._views: list[torch.Tensor] | None = None  # _direct_views, made on first use

    def close(self) -> None:
        """Unlock the host memory locked for staging, once no copy reads it (idempotent)."""
        self.streams.host_waits()
        if self.streams.cuda:
            self.streams.copy.synchronize()
        self.home.close()
        if self.experts.worker is not None:
            self.experts.worker.close()
            self.experts.worker = None

    def __del__(self) -> None:
        home = getattr(self, "home", None)
        if home is not None:
            with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone
                self.close()

    # -- the executor protocol ------------------------------------------------------------------

    def moe_layers(self) -> list[int]:
        return list(self._moe)

    def new_cache(self, max_tokens: int) -> KVCache:
        """A KV cache on the device, its storage fixed for its life."""
        return KVCache(self.config, max_tokens, self.device, self.dtype, growable=False)

    def synchronize(self) -> None:
        self.streams.host_waits()

    def set_misses(self, misses: str, costs: Costs | None = None) -> None:
        """Where misses are computed: auto (staged in a cache; with no slots or transit slots,
        decode steps as direct and a prompt's misses split by `costs`, which measure_costs
        makes on this executor), cpu, stage, or direct."""
        self.experts.set_misses(misses, costs)

    @property
    def costs(self) -> Costs | None:
        return self.experts.costs

    def set_expert_threshold(self, thresholds: Sequence[float] | None) -> None:
        """Per-layer |act(gate)| thresholds (None = dense), the same on the CPU and the GPU
        (whose dense/sparse switch is the default one: the hybrid has no resident layer to
        profile it on)."""
        self.experts.threshold = None if thresholds is None else list(thresholds)
        self.experts.cpu_active = [0, 0]
        self.layers.set_sparsity(thresholds)

    @property
    def expert_threshold(self) -> list[float] | None:
        return self.experts.threshold

    def cpu_experts(self, layer: int, experts: Sequence[int], x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> tuple[torch.Tensor, int]:  # fmt: skip
        """The C core's share of a layer (SplitExperts.cpu_experts; costs.measure_costs)."""
        return self.experts.cpu_experts(layer, experts, x, ids, weights)

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
        `tokens` at positions cache.n_tokens.., which the cache then holds (the Executor
        protocol: pyruntime.model.executor)."""
        k = check_k(k, self.config)
        decode = single_token(tokens, self.config.n_vocab) is not None
        self.stats.begin("decode" if decode else "prefill")
        start = time.perf_counter()
        if decode and self._last_decode_end is not None:
            self.offload.between_seconds += start - self._last_decode_end
        try:
            with torch.inference_mode():
                logits, n = self._forward(tokens, cache, last_only, k, routing)
        except torch.OutOfMemoryError:
            slot_bytes = gib(self.slots.n_slots * self.experts.expert_bytes)
            raise DeviceMemoryError(
                f"the GPU ran out of memory while running the model on {self.device} (its "
                f"{self.slots.n_slots} expert slots take {slot_bytes}): lower --gpu-mem or "
                "--ctx-size"
            ) from None
        finally:
            self.experts.release(self.experts.prefetch_holds | self.experts.lookahead_holds)
        self.offload.passes += 1
        self.offload.tokens += n
        self.offload.decode_steps += decode
        self._last_decode_end = time.perf_counter() if decode else None
        return logits

    @contextlib.contextmanager
    def resident_experts_only(self):
        """Passes inside compute each token's routed experts that sit in GPU slots and drop
        the others (no copy, no CPU work; the lookahead stages nothing): a draft that moves no
        bytes (pyruntime.decoding.big_little's resident draft). Not exact: the logits are the
        model's with the missing experts' terms left out."""
        previous = self.experts.resident_only
        self.experts.resident_only = True
        try:
            yield
        finally:
            self.experts.resident_only = previous

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Stage `experts` of MoE layer `layer` into slots now (asynchronously), held there
        until the next forward pass ends; those no slot can take are read ahead from the file."""
        if layer not in self._moe:
            return
        wanted = list(dict.fromkeys(int(e) for e in experts))
        self.offload.prefetched += len(self.experts.stage(layer, wanted, hold=True))
        if self.file is not None and self.home.mode != "pinned":
            for e in wanted:
                if self.cache.residency.slot(layer, e) < 0:
                    self.file.advise_willneed(self.home.cpu_view(layer)[e])

    def offload_stats(self) -> dict:
        """The hybrid's counters (pyruntime.offload.stats) as a dict for Model.stats()."""
        self.offload.timer_seconds = dict(self.timer.seconds)
        share = self.slots.n_slots / (len(self._moe) * self.config.n_expert)
        return self.offload.as_dict(self.cache.stats, self.slots.n_slots, min(1.0, share))

    # -- a pass ---------------------------------------------------------------------------------

    def _forward(self, tokens, cache: KVCache, last_only: bool, k: int,
                 routing: RoutingTrace | None) -> tuple[torch.Tensor, int]:  # fmt: skip
        state = self._state(cache)
        trace: list | None = None if routing is None else []
        token = single_token(tokens, self.config.n_vocab)
        if token is not None:
            logits, n = self._decode(state, token, cache, k, trace), 1
        else:
            logits, n = self._prefill(state, tokens, cache, last_only, k, trace)
        if routing is not None:
            routing.layers = self.moe_layers()
            routing.ids = torch.stack([ids for ids, _ in trace]).long()
            routing.logits = torch.stack([lg for _, lg in trace]).float()
        return logits, n

    def _prefill(self, state: GpuCacheState, tokens, cache: KVCache, last_only: bool, k: int,
                 trace: list | None) -> tuple[torch.Tensor, int]:  # fmt: skip
        """Several tokens, eagerly, layer by layer."""
        ids = token_ids(tokens, self.config.n_vocab)
        cache.reserve(ids.numel())
        start = cache.n_tokens
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        span = Span(ids.to(self.device), positions, state.cos, state.sin, start=start)
        layers, timer = self.layers, self.timer
        if self.embedding is None:
            x = layers.embed(span.ids)
        else:
            x = self.embedding.upload(ids, self.device)
        delta = None
        for i, blk in enumerate(self.host.blocks):
            mark = timer.start()
            x, delta = layers.mixer(i, x, delta, cache, span)
            mark = timer.stop("attention", mark)
            if blk.experts is None:
                x, h, _ = layers.ffn_norm(i, x, delta)
                delta = layers.dense_ffn(i, h)
                continue
            r = layers.route(i, x, delta, k)
            timer.stop("router", mark)
            y = self.experts(i, r, trace)
            delta = layers.ffn_output(i, r, y)
            x = r.x
        self.stats.flush()
        if last_only:
            x, delta = x[-1:], delta[-1:]
        logits = self.streams.to_host(layers.output(x, delta).float())
        self.streams.host_waits()
        timer.collect()
        cache.end_pass(cache.n_tokens + span.n, span.n)  # a recurrent state's snapshot
        return logits, span.n

    def _decode(self, state: GpuCacheState, token: int, cache: KVCache, k: int,
                trace: list | None) -> torch.Tensor:  # fmt: skip
        """One token: the step's graph segments (pyruntime.offload.segments), each MoE layer's
        experts placed by the host between two of them."""
        cache.reserve(1)
        state.set_step(token, cache.n_tokens)
        if self._direct_views() is not None:
            return self._decode_direct(state, token, cache, k, trace)
        seg = self._segments(state, cache, k)
        self._embed_step(seg, token)
        timer, streams = self.timer, self.streams
        for m, i in enumerate(self._moe):
            seg.prepare(m)
            mark = timer.start()
            r = seg.run(m)
            timer.stop("dense", mark)
            t = time.perf_counter()
            streams.host_waits()
            self.offload.route_wait_seconds += time.perf_counter() - t
            self.experts.decode(i, r, seg, trace)
        seg.prepare(len(self._moe))
        mark = timer.start()
        seg.run(len(self._moe))
        timer.stop("dense", mark)
        return self._end_step(seg, cache)

    def _end_step(self, seg: HybridStep, cache: KVCache) -> torch.Tensor:
        """A decode step's end, after its last segment is queued: the stats' device counts,
        the wait for the logits, the step's part times; the cache one token longer."""
        self.stats.flush()
        self.streams.host_waits()
        self.timer.collect()
        cache.n_tokens += 1
        return seg.logits.clone()

    def _embed_step(self, seg: HybridStep, token: int) -> None:
        """The step's embedded token into seg's x0, where the embedding is in host memory. The
        previous step's copy of it has run: its logits came back."""
        if seg.x0_host is not None:
            self.embedding.row(token, seg.x0_host)

    def _direct_views(self) -> list[torch.Tensor] | None:
        """Each MoE layer's experts as a kernel reads them in place from host memory, when a
        decode step runs direct (misses='direct', or 'auto' where the slots are no cache; no
        lookahead, the experts not input-weighted, the home mapped for the device); else None."""
        experts = self.experts
        # auto where the slots do not keep a token's experts (none, or transit slots): direct.
        # olmoe-1b-7b Q8_0, 16 threads, tg64: no slots 1.53x all on the CPU (H100 host); 16
        # transit slots (H200 host) direct 103.0 / 102.0 tok/s, all on the CPU 80.0 / 81.6, the
        # cost model's split between the CPU and staging 45.5 / 41.1, every miss staged 46.7
        direct = experts.misses == "direct" or (experts.misses == "auto"
                                                and not experts.slots_keep)  # fmt: skip
        if (
            not direct
            or experts.lookahead
            or experts.resident_only
            or self.config.expert_input_weight
        ):
            return None
        if self._views is None:
            views = [self.home.device_view(i, self.device) for i in self._moe]
            self._views = views if all(v is not None for v in views) else []
            if not self._views and experts.misses == "direct":
                warnings.warn("misses='direct' needs the experts' host memory mapped for the "
                              "GPU (--staging register or pinned): the misses are split as "
                              "auto", PyruntimeWarning, stacklevel=3)  # fmt: skip
        return self._views or None

    def _decode_direct(self, state: GpuCacheState, token: int, cache: KVCache, k: int,
                       trace: list | None) -> torch.Tensor:  # fmt: skip
        """One token as one graph (pyruntime.offload.step_graph): the GPU reads its share of
        each layer's misses in place, the host computes the CPU's between two flags."""
        key = ("direct", k)
        graph = state.segments.get(key)
        if graph is None:
            span = Span(state.token, state.position, state.cos, state.sin, seq_len=state.seq_len)
            first = self.host.blocks[self._moe[0]].experts
            graph = StepGraph(
                self.layers, self._moe, cache, span, k, self.device, self._views,
                FORMAT_NAMES[first.qtype], self.slots.tensor if self.slots.n_slots else None,
                self.config.n_expert,
                lambda m, count: self.experts.direct_cpu_share(m, graph, graph.trace, count),
                lambda step: self.experts.direct_host_step(graph, graph.trace, step),
                host_embedding=self.embedding is not None,
            )  # fmt: skip
            state.segments[key] = graph
        graph.trace = trace
        self._embed_step(graph, token)
        table = graph.table.numpy()
        slots = self.cache.residency.slots
        np.stack([slots[i] for i in self._moe], out=table)
        resident = table[table >= 0].tolist()
        graph.n_direct.numpy()[:] = self.experts.direct_counts(k, len(self._moe))
        if resident:
            self.slots.wait_ready(resident)
        mark = self.timer.start()
        waited = graph.step()
        self.timer.stop("dense", mark)
        self.offload.route_wait_seconds += waited
        if resident:
            self.slots.mark_read(resident)
        active, direct_bytes = graph.counts()
        self.stats.add(0, active, self.config.n_ff_exp)
        self.offload.direct_bytes += direct_bytes
        return self._end_step(graph, cache)

    def _segments(self, state: GpuCacheState, cache: KVCache, k: int) -> DecodeSegments:
        """The decode step's segments at k on this cache, made on first use."""
        lookahead = self.experts.lookahead
        key = (k, lookahead)
        seg = state.segments.get(key)
        if seg is None:
            experts = self.experts

            def predict(i: int, r: Routed) -> torch.Tensor | None:
                ahead = experts.next_moe.get(i) if lookahead else None
                return None if ahead is None else experts._predict(ahead, r, k)

            span = Span(state.token, state.position, state.cos, state.sin, seq_len=state.seq_len)
            seg = DecodeSegments(self.layers, self._moe, cache, span, k, predict, self.device,
                                 host_embedding=self.embedding is not None)  # fmt: skip
            state.segments[key] = seg
        return seg

    def _state(self, cache: KVCache) -> GpuCacheState:
        state = cache.executor_state.get(STATE_KEY)
        if state is None or state.owner_id != id(self):
            if cache.growable or cache.device != self.device or cache.dtype != self.dtype:
                raise UsageError(
                    f"this KV cache ({cache.dtype} on {cache.device}, growable={cache.growable}) "
                    "was not made by this executor: use its new_cache()"
                )
            with torch.inference_mode(False):  # the step inputs are rewritten outside it
                state = GpuCacheState(self, self.config, cache.max_tokens, self.device)
            cache.executor_state[STATE_KEY] = state
        return state

    def time_gpu_experts(self, n: int, n_tokens: int, reps: int) -> tuple[float, float]:
        """Median seconds of the GPU's expert kernel over slots 0..n-1 as experts 0..n-1 of the
        first MoE layer, n_tokens tokens each routed to all n, and of the host's launch of it
        (costs.measure_costs)."""
        layer, cfg = self._moe[0], self.config
        h = torch.randn(n_tokens, cfg.n_embd, device=self.device).to(self.dtype)
        ids = torch.arange(n, device=self.device).repeat(n_tokens, 1)
        w = torch.full((n_tokens, n), 1.0 / n, device=self.device)
        r = Routed(h.float(), h, h.float(), ids, w, w)
        emap = torch.full((cfg.n_expert,), -1, dtype=torch.int32)
        emap[:n] = torch.arange(n, dtype=torch.int32)
        emap = emap.to(self.device)
        times, launches = [], []
        with torch.inference_mode():
            for _ in range(reps + 1):
                self.streams.host_waits()
                t = time.perf_counter()
                self.layers.routed_experts(layer, r, emap, self.slots.tensor)
                launches.append(time.perf_counter() - t)
                self.streams.host_waits()
                times.append(time.perf_counter() - t)
        return float(np.median(times[1:])), float(np.median(launches[1:]))
