"""A hybrid decode step as CUDA graph segments: one graph per stretch of GPU work between two
MoE layers' routed experts.

The host decides each MoE layer's placement from its routing, so a decode step cannot be one
graph (as the whole-GPU executor's is); launched eagerly from Python, a layer's ~10 dense
launches cost more host time than its GPU time. With M MoE layers, a step is M + 1 segments:

    segment 0   embed (or, with the embedding in host memory, copy up the row the host wrote
                into x0); the layers before the first MoE layer; attention + route of MoE
                layer 0
    segment m   y = y_gpu + y_cpu (MoE layer m-1's routed output); its FFN output (+ shared
                expert); the dense-FFN layers between; attention + route of MoE layer m
    segment M   y, the FFN output of the last MoE layer, the layers after it, norm + lm_head

Each segment but the last ends with copies of what the host needs into page-locked host memory
(`StepBuffers`): the layer's top-k ids (int32) and weights, the experts' input h (f32), the
router logits (routing traces) and, with the lookahead, the next MoE layer's predicted experts;
the last one copies the logits. Between two segments the host places the layer's experts
(pyruntime.offload.split.SplitExperts.decode): the GPU's share lands in y_gpu (device), the C
core's in y_cpu (host), and the next segment adds the two. The GPU's share is a graph too
(`gpu_experts`: the expert map copied up from host memory, the expert kernel over the slots,
the stats' counts), replayed once the slots' copies landed. A step is then M + 1 segment
replays, M host waits, M C calls and a replay per layer with experts in slots: the Python of
~10 launches a layer (~30 us each on the device host) is gone.

Graphs are captured per (k, lookahead) on the first step that needs them, each right before its
first replay (its inputs are then the real ones: the capture's warm-up run has a step's side
effects, rewritten by the replay, but for a Gated DeltaNet layer's recurrent state, which the
warm-up advances and `prepare` puts back), in one memory pool: they replay in the order they were
captured, never at once. Their inputs and outputs stay at fixed addresses for the life of the
KV cache they belong to (in its GpuCacheState). A segment clones the residual stream it starts
from: the first norm adds to it in place, and the warm-up run must not add twice. On a CPU
device (tests) every segment runs eagerly: the same code on the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pyruntime.gpu import cache_state
from pyruntime.gpu.layers import DecoderLayers, Routed, Span
from pyruntime.model.kv_cache import KVCache
from pyruntime.offload.host_register import page_locked

ALIGN = 64  # bytes between the starts of two host buffers

_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
# host buffers by name: (shape, dtype)
HostShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class StepBuffers:
    """Host tensors of one decode step in one block of page-locked memory from the CUDA driver
    (pyruntime.offload.host_register.page_locked: copies into it are captured in the
    segments' graphs); plain memory on a CPU device. A refused allocation leaves `capturable`
    False: the buffers are then torch's pinned memory, and the segments run eagerly."""

    def __init__(self, shapes: HostShapes, cuda: bool) -> None:
        offsets, total = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = total
            nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
            total += -(-nbytes // ALIGN) * ALIGN
        block = allocate_block(total) if cuda else np.empty(total, dtype=np.uint8)
        self.capturable = block is not None
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in shapes.items():
            if block is None:
                self.tensors[name] = torch.zeros(shape, dtype=dtype, pin_memory=True)
                continue
            n = int(np.prod(shape))
            view = block[offsets[name] :].view(_NUMPY[dtype])[:n].reshape(shape)
            view.fill(0)  # y_cpu is read before the C core first writes it
            self.tensors[name] = torch.from_numpy(view)


def allocate_block(nbytes: int) -> np.ndarray | None:
    """The step buffers' memory on a GPU (None: refused)."""
    return page_locked(nbytes)


class HybridStep:
    """What the two forms of a hybrid decode step on one KV cache share: DecodeSegments (a
    graph per stretch between two MoE layers, the host placing each layer's experts) and
    pyruntime.offload.step_graph.StepGraph (one graph, the placement a rule on the device).
    That is the host buffers (StepBuffers) the routing goes out to and the C core's share and
    the logits come back in, the C calls bound to them, the graphs' memory pool, and the dense
    stretch between two MoE layers' experts (_segment). A subclass says where the routing goes
    (_publish) and what the previous MoE layer's routed output is (_routed_output); `host`
    adds its own host buffers (name -> (shape, dtype)) to the same block, in self.host_buffers."""

    def __init__(self, layers: DecoderLayers, moe: list[int], cache: KVCache, span: Span, k: int,
                 device: torch.device, host_embedding: bool = False,
                 host: HostShapes | None = None) -> None:  # fmt: skip
        """host_embedding: the step's embedded token comes from x0, which the host writes
        before segment 0 runs (pyruntime.offload.embedding), not from a lookup on the GPU."""
        cfg = layers.config
        self.layers, self.moe, self.cache, self.span, self.k = layers, moe, cache, span, k
        self.device = device
        self.cuda = device.type == "cuda"
        shapes = {"x0": ((1, cfg.n_embd), torch.float32)} if host_embedding else {}
        buffers = StepBuffers(
            {
                **shapes,
                "ids": ((1, k), torch.int32),
                "weights": ((1, k), torch.float32),
                "h": ((1, cfg.n_embd), torch.float32),
                "router_logits": ((1, cfg.n_expert), torch.float32),
                "y_cpu": ((1, cfg.n_embd), torch.float32),
                "logits": ((1, cfg.n_vocab), torch.float32),
                **(host or {}),
            },
            self.cuda,
        )  # fmt: skip
        self.host_buffers = buffers.tensors
        # MoE layer -> its C call bound to these buffers (SplitExperts._decode_call)
        self.cpu_calls: dict[int, tuple] = {}
        t = buffers.tensors
        self.ids, self.weights, self.h = t["ids"], t["weights"], t["h"]
        self.router_logits, self.y_cpu, self.logits = t["router_logits"], t["y_cpu"], t["logits"]
        self.x0: torch.Tensor | None = t.get("x0")  # [1, n_embd] f32: the step's embedded token
        self.x0_host = None if self.x0 is None else self.x0.numpy()
        self.capture = self.cuda and buffers.capturable
        self.routed: list[Routed | None] = [None] * len(moe)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def _segment(self, m: int) -> Routed | None:
        """The step's dense stretch m (module doc: segment m); MoE layer m's Routed (None for
        the last stretch, which leaves the logits in self.logits)."""
        layers, moe = self.layers, self.moe
        if m == 0:
            if self.x0 is None:
                x = layers.embed(self.span.ids)
            else:  # a new tensor: the first norm adds to it in place
                x = torch.empty(self.x0.shape, device=self.device).copy_(self.x0, non_blocking=True)
            delta, first = None, 0
        else:
            prev, r = moe[m - 1], self.routed[m - 1]
            delta = layers.ffn_output(prev, r, self._routed_output())
            x, first = r.x.clone(), prev + 1
        last = moe[m] if m < len(moe) else layers.config.n_layer
        for i in range(first, last):  # dense-FFN layers
            x, delta = layers.mixer(i, x, delta, self.cache, self.span)
            x, h, _ = layers.ffn_norm(i, x, delta)
            delta = layers.dense_ffn(i, h)
        if m == len(moe):
            self.logits.copy_(layers.output(x, delta).float(), non_blocking=True)
            return None
        i = moe[m]
        x, delta = layers.mixer(i, x, delta, self.cache, self.span)
        r = layers.route(i, x, delta, self.k)
        self._publish(i, r)
        return r

    def _routed_output(self) -> torch.Tensor:
        """The previous MoE layer's routed output on the device [1, n_embd] f32."""
        raise NotImplementedError

    def _publish(self, i: int, r: Routed) -> None:
        """MoE layer i's routing into the host buffers (copies the host waits for)."""
        self.ids.copy_(r.ids.to(torch.int32), non_blocking=True)
        self.weights.copy_(r.weights, non_blocking=True)
        self.h.copy_(r.h32.float(), non_blocking=True)
        self.router_logits.copy_(r.logits, non_blocking=True)


class DecodeSegments(HybridStep):
    """The segments of a decode step at k experts per token (module doc) on one KV cache.
    predict(i, r): MoE layer i's lookahead (the next MoE layer's likely experts [k] int64 on
    the device) or None (no lookahead, or no next layer)."""

    def __init__(self, layers: DecoderLayers, moe: list[int], cache: KVCache,
                 span: Span, k: int, predict: Callable[[int, Routed], torch.Tensor | None],
                 device: torch.device, host_embedding: bool = False) -> None:  # fmt: skip
        cfg = layers.config
        # beside the routing: the lookahead's experts [k] and the host's expert map for the
        # GPU's share (expert -> slot, -1 elsewhere)
        host = {"predicted": ((k,), torch.int64), "emap": ((cfg.n_expert,), torch.int32)}
        super().__init__(layers, moe, cache, span, k, device, host_embedding, host)
        self.predict = predict
        self.predicted, self.emap = self.host_buffers["predicted"], self.host_buffers["emap"]
        self.y_gpu = torch.zeros(1, cfg.n_embd, device=device)
        # the GPU's experts of a layer (gpu_experts): the expert map on the device, and per
        # MoE layer its graph and where it leaves the stats' counts
        self._dmap = torch.full((cfg.n_expert,), -1, dtype=torch.int32, device=device)
        self._expert_graphs: list = [None] * len(moe)
        self._expert_state: tuple | None = None  # the sparsity the graphs were captured with
        self._active = [torch.zeros((1, k), dtype=torch.int32, device=device) for _ in moe]
        self._gathered = [torch.zeros((1, k), dtype=torch.int32, device=device) for _ in moe]
        self._has_active = [False] * len(moe)
        self.gpu_written = self.cpu_written = False  # y_gpu / y_cpu hold a layer's output
        self._graphs: list = [None] * (len(moe) + 1)

    @property
    def n_segments(self) -> int:
        return len(self.moe) + 1

    def prepare(self, m: int) -> None:
        """Capture segment m if it has no graph yet (before `run`, so that timing the run
        leaves the capture out)."""
        if self.capture and self._graphs[m] is None:
            recurrent = self.cache.recurrent
            saved = None if recurrent is None else recurrent.copy()
            graph, out = cache_state.capture(lambda: self._segment(m), self.device,
                                             pool=self._pool)  # fmt: skip
            if saved is not None:  # the warm-up run advanced it; the replay does
                recurrent.load(saved)
            self._graphs[m] = graph
            if m < len(self.moe):
                self.routed[m] = out

    def run(self, m: int) -> Routed | None:
        """Queue segment m (prepared); MoE layer m's Routed (None for the last segment). The
        host buffers hold its copies once the host waited for the compute stream."""
        if self.capture:
            self._graphs[m].replay()
        else:
            out = self._segment(m)
            if m < len(self.moe):
                self.routed[m] = out
        return self.routed[m] if m < len(self.moe) else None

    def gpu_experts(self, m: int, slots: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """y_gpu = MoE layer m's routed experts over `slots` through the expert map in
        self.emap (host: expert -> slot, -1 elsewhere), as one graph replay (captured on first
        use, again after the sparsity changed); returns the stats' (active counts [1, k] or
        None where the dense path ran, the map applied to the routing [1, k]), rewritten by
        this layer's next call. The caller orders the compute stream after the slots' copies."""
        layers = self.layers
        state = (layers.expert_threshold, layers.sparse_switch)
        if self._expert_state is None or any(a is not b for a, b in zip(state, self._expert_state,
                                                                        strict=True)):  # fmt: skip
            self._expert_graphs = [None] * len(self.moe)
            self._expert_state = state  # held: the graphs read its threshold tensors
        if not self.capture:
            self._experts(m, slots)
        else:
            if self._expert_graphs[m] is None:
                self._expert_graphs[m], _ = cache_state.capture(
                    lambda: self._experts(m, slots), self.device, pool=self._pool
                )
            self._expert_graphs[m].replay()
        self.gpu_written = True
        return (self._active[m] if self._has_active[m] else None), self._gathered[m]

    def _experts(self, m: int, slots: torch.Tensor) -> None:
        r = self.routed[m]
        self._dmap.copy_(self.emap, non_blocking=True)
        y, active = self.layers.routed_experts(self.moe[m], r, self._dmap, slots)
        self.y_gpu.copy_(y)
        self._has_active[m] = active is not None
        if active is not None:
            self._active[m].copy_(active)
        self._gathered[m].copy_(self._dmap[r.ids])

    def set_gpu_share(self, y: torch.Tensor | None) -> None:
        """y_gpu = the GPU's share of the layer's routed output (None: zero)."""
        if y is not None:
            self.y_gpu.copy_(y)
            self.gpu_written = True
        elif self.gpu_written:
            self.y_gpu.zero_()
            self.gpu_written = False

    def set_cpu_share(self, written: bool) -> None:
        """Whether the C core wrote y_cpu for this layer (else it is zeroed, once)."""
        if written:
            self.cpu_written = True
        elif self.cpu_written:
            self.y_cpu.zero_()
            self.cpu_written = False

    def _routed_output(self) -> torch.Tensor:
        """The previous MoE layer's routed output on the device: its two shares added."""
        return self.y_gpu + self.y_cpu.to(self.device, non_blocking=True)

    def _publish(self, i: int, r: Routed) -> None:
        """MoE layer i's routing into the host buffers, and its lookahead where it has one."""
        super()._publish(i, r)
        predicted = self.predict(i, r)
        if predicted is not None:
            self.predicted.copy_(predicted, non_blocking=True)
