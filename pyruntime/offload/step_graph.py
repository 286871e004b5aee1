"""A hybrid decode step as ONE CUDA graph: the GPU reads its share of the misses in place from
host memory, the host computes the CPU's share between two flags, and nothing is launched per
layer (`--misses direct`).

The segmented step (pyruntime.offload.segments) returns to the host at every MoE layer: the host
waits for the routing, places the experts, replays the GPU's share and calls the C core, ~250 us
of host time a layer beside the C call on the device host. Here the placement is a rule the
graph applies on the device, so the step is captured whole. Per MoE layer, on the GPU:

    route; place (one kernel): code each of the k pairs 0 = in a slot, 1 = direct (the first
    `n_direct` misses by rank), 2 = CPU, build the two expert maps, write the routing, h and the
    codes into page-locked host memory and then flags[0, m] = step; the slots' kernel over the
    hits; the direct pairs' experts gathered from the mapped GGUF with wide loads (over PCIe,
    ~45 GB/s, at the same time as the CPU's DRAM reads) and the experts' kernel over them;
    absorb: one kernel waits until flags[1, m] == step and adds y_cpu, read in place, to y_gpu;
    on.

and on the host, after the replay is queued, one C call (CpuCore.bind_host_step, bound once to
the buffers) for each MoE layer in turn: spin until flags[0, m] == step, compute the pairs coded
2 into y_cpu, flags[1, m] = step (kernels.host_flags: a round trip ~4.4 us); no Python between
the layers (a turn in Python cost ~42 us of host time a layer, H100 host), the routing logged
for the step's counts after it. The slots stay as they are
during the step (the cache is not updated by a decode step in this mode: its hits are what a
prefill or a prefetch left there); the table of which slot holds what is copied up at each
step's start.

On a CPU device (tests), or when page-locked buffers are refused, the same step runs eagerly: at
each MoE layer the host's share runs inline where the GPU would wait. The capture's warm-up run
is such an eager run.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kernels import host_flags
from kernels.expert_formats import generic_only
from kernels.expert_gather import gather_experts, gather_neuron_rows
from kernels.moe_sparse import moe_gate, moe_sparse_up_down
from kernels.sparse_mask import sparse_mask
from pyruntime.cpu.core import CoreTimeout
from pyruntime.errors import DeviceMemoryError
from pyruntime.gpu import cache_state
from pyruntime.gpu.layers import DecoderLayers, Routed, Span
from pyruntime.model.kv_cache import KVCache
from pyruntime.offload.host_register import mapped_tensor
from pyruntime.offload.segments import HybridStep

HOST_WAIT_S = 30.0  # the host gives up on a flag after this long (a GPU fault)
SLOT, DIRECT, CPU = 0, 1, 2  # a pair's code


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No cyclic garbage collection inside: while a replayed step's graph waits for the host's
    flags, a collected object's finalizer that frees page-locked or device memory (a dropped
    executor's step buffers: cuMemFreeHost) synchronizes the device, so it would wait for the
    graph, which waits for the host: a deadlock until the graph's wait gives up. Collections
    resume after the step (the garbage is not lost, only later)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class StepGraph(HybridStep):
    """The decode step of `segments.DecodeSegments` at k experts per token, captured whole
    (module doc): the host buffers and the dense stretches are segments.HybridStep's; none of
    the segments' own (y_gpu, a graph per segment, the GPU share's expert map and graphs).
    direct[m]: MoE layer m's experts read in place (ExpertHome.device_view),
    fmt: their GGUF format; slots: the slot tensor, in the layers' slot format (None: no
    slots); cpu_share(m, count): the host's share of MoE layer m in an eager run (reads ids,
    codes, h, weights, writes y_cpu; count: in the stats, False for the capture's warm-up
    run); host_step(step): the host's turns of a replay (module doc), returning the seconds
    it waited for the graph; host_embedding: as HybridStep's."""

    def __init__(self, layers: DecoderLayers, moe: list[int], cache: KVCache, span: Span, k: int,
                 device: torch.device, direct: list[torch.Tensor], fmt: str,
                 slots: torch.Tensor | None, n_expert: int,
                 cpu_share: Callable[[int, bool], None], host_step: Callable[[int], float],
                 host_embedding: bool = False) -> None:  # fmt: skip
        n_moe = len(moe)
        # beside the routing: each pair's code [1, k], the flags [2, n_moe] (0: the graph's
        # "routing published", 1: the host's "y_cpu written", each the step's number), the
        # slots' table [n_moe, n_expert] (expert -> slot, -1) and the misses read in place per
        # MoE layer [n_moe], the last two written by the caller before each step
        host = {
            "codes": ((1, k), torch.int32),
            "flags": ((2, n_moe), torch.int32),
            "table": ((n_moe, n_expert), torch.int32),
            "n_direct": ((n_moe,), torch.int32),
            # the step's log and its failure flag (below), copied down after each replay
            "readback": ((n_moe * 3 * k + 1,), torch.int32),
        }  # fmt: skip
        super().__init__(layers, moe, cache, span, k, device, host_embedding, host)
        self.direct, self.fmt, self.slots = direct, fmt, slots
        self.cpu_share, self.host_step = cpu_share, host_step
        t = self.host_buffers
        self.codes, self.flags, self.table = t["codes"], t["flags"], t["table"]
        self.n_direct, self._readback = t["n_direct"], t["readback"]
        self._readback_np = self._readback.numpy()
        # the host buffers the graph writes (routing) and reads (y_cpu) in place
        mapped = [mapped_tensor(a.numpy(), device) if self.capture else None for a in
                  (self.flags, self.ids[0], self.weights[0], self.codes[0], self.h[0],
                   self.router_logits[0], self.y_cpu[0])]  # fmt: skip
        self.capture = self.capture and all(t is not None for t in mapped)
        self._flags_dev, self._mapped_out, self._mapped_y_cpu = mapped[0], mapped[1:6], mapped[6]
        self._y_sum = torch.zeros(1, layers.config.n_embd, device=device)
        # the direct experts of a layer, gathered from host memory (kernels.expert_gather):
        # k experts at most (~53 MB for olmoe's or gpt-oss's k; inside the plan's work reserve)
        self._gathered_experts = torch.empty((k, *direct[0].shape[1:]), dtype=direct[0].dtype,
                                             device=device)  # fmt: skip
        self._table_dev = torch.full((n_moe, n_expert), -1, dtype=torch.int32, device=device)
        self._n_direct_dev = torch.zeros(n_moe, dtype=torch.int32, device=device)
        self._dmap_slots = torch.full((n_expert,), -1, dtype=torch.int32, device=device)
        self._dmap_direct = torch.full((n_expert,), -1, dtype=torch.int32, device=device)
        self._rows_dev = torch.zeros(k, dtype=torch.int32, device=device)
        self._seq = torch.zeros(1, dtype=torch.int32, device=device)
        # One tensor, copied to the page-locked readback by one copy queued behind each replay
        # (after the step's sync both parts are in host memory; a .cpu() and an .item() after
        # it cost ~0.1 ms a token of host time): the step's log [n_moe, 3, k] for counts(),
        # summed on the host after the step (not in the graph: sums a layer are ~a dozen
        # one-microsecond kernels, ~0.3 ms a token on the GPU's path), and the graph's failure
        # flag (its wait for the host gave up: 1). Per MoE layer the log holds [0] the pairs'
        # codes (written by the placement itself), [1] / [2] the neurons the slots' / the
        # direct pairs' sparse kernels kept per pair (0 for the other pairs); sparse[m] = which
        # of the two ran sparse at layer m (fixed at capture, as the graph's kernels are)
        self._tail = torch.zeros(n_moe * 3 * k + 1, dtype=torch.int32, device=device)
        self._log, self._failed = self._tail[:-1].view(n_moe, 3, k), self._tail[-1:]
        self._sparse = [(False, False)] * n_moe
        shape = direct[0].shape  # [n_expert, n_ff, 3, row]
        self._row_bytes = shape[3] * direct[0].element_size()
        self._expert_bytes = shape[1] * 3 * self._row_bytes
        self.host_seq = 0
        self._graph = None
        self._warming = False  # the capture's warm-up run: the host's share is not counted
        self.trace: list | None = None  # this step's routing trace (the caller's)

    def step(self) -> float:
        """Run one decode step (table and n_direct set by the caller); y_cpu's of every MoE
        layer computed by host_step (by cpu_share where the step runs eagerly); logits in
        self.logits once the stream is done. Returns the seconds the host waited for the
        graph's signals (the GPU's dense work between two layers' experts, and the signal's
        trip)."""
        if not self.capture:
            self._step()
            return 0.0
        if self._graph is None:
            recurrent = self.cache.recurrent
            saved = None if recurrent is None else recurrent.copy()
            self._warming = True
            try:
                self._graph, _ = cache_state.capture(self._step, self.device, pool=self._pool)
            finally:
                self._warming = False
            if saved is not None:  # the warm-up run advanced it; the replay does
                recurrent.load(saved)
        self.host_seq += 1
        with no_collection():
            self._graph.replay()
            self._readback.copy_(self._tail, non_blocking=True)
            try:
                waited = self.host_step(self.host_seq)
            except BaseException as e:
                self.flags[1, :] = self.host_seq  # let the graph run to its end before raising
                torch.cuda.current_stream(self.device).synchronize()
                if isinstance(e, CoreTimeout):
                    raise DeviceMemoryError(f"the decode step's GPU graph stalled ({e})") from None
                raise
            torch.cuda.current_stream(self.device).synchronize()
        if self._readback_np[-1]:
            raise DeviceMemoryError("the decode step's graph gave up waiting for the host")
        return waited

    def counts(self) -> tuple[int, int]:
        """The last step's (neurons the GPU's pairs kept, bytes its direct pairs read from
        host memory), after it."""
        if self._graph is None:  # an eager step: its log is on the device
            self._readback.copy_(self._tail)
        log = self._readback_np[:-1].reshape(self._log.shape).astype(np.int64)
        codes, kept = log[:, 0], log[:, 1:].sum(axis=2)  # [n_moe, k], [n_moe, 2]
        sparse = np.array(self._sparse, dtype=bool)  # [n_moe, 2]
        n_ff = self.layers.config.n_ff_exp
        n_direct = (codes == DIRECT).sum(axis=1)
        gpu_active = np.where(sparse[:, 1], kept[:, 1], n_direct * n_ff).sum()
        if self.slots is not None:
            n_slot = (codes == SLOT).sum(axis=1)
            gpu_active += np.where(sparse[:, 0], kept[:, 0], n_slot * n_ff).sum()
        # sparse: every gate row, then the kept neurons' up and down rows; dense: whole experts
        direct_bytes = np.where(sparse[:, 1], (n_direct * n_ff + 2 * kept[:, 1]) * self._row_bytes,
                                n_direct * self._expert_bytes).sum()  # fmt: skip
        return int(gpu_active), int(direct_bytes)

    # -- the step's device work -------------------------------------------------------------------

    def _step(self) -> None:
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            host_flags.advance(self._seq)
        self._table_dev.copy_(self.table, non_blocking=True)
        self._n_direct_dev.copy_(self.n_direct, non_blocking=True)
        for m in range(len(self.moe) + 1):
            r = self._segment(m)
            if m == len(self.moe):
                break
            self.routed[m] = r
            self._experts_step(m, r, capturing)

    def _publish(self, i: int, r: Routed) -> None:
        """Nothing yet: the routing goes to the host with the codes (_experts_step)."""

    def _routed_output(self) -> torch.Tensor:
        return self._y_sum

    def _experts_step(self, m: int, r: Routed, capturing: bool) -> None:
        """MoE layer m's routed experts (module doc): the placement (and, in the graph, the
        routing published to the host) in one launch, the GPU's share, then the two shares
        added into self._y_sum once the host's is there."""
        ids = r.ids[0]  # [k]
        codes = self._log[m, 0]
        out = (codes, self._rows_dev, self._dmap_slots, self._dmap_direct)
        publish = None
        if capturing:
            publish = (r.weights[0], r.h32[0], r.logits[0], self._mapped_out, self._flags_dev[0],
                       self._seq, m)  # fmt: skip
        host_flags.place(ids, self._table_dev[m], self._n_direct_dev[m : m + 1], out, publish)
        if not capturing:
            HybridStep._publish(self, self.moe[m], r)
            self.codes.copy_(codes[None], non_blocking=True)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            self.cpu_share(m, not self._warming)
        y = None
        i = self.moe[m]
        slots_sparse = False
        if self.slots is not None:
            y, active = self.layers.routed_experts(i, r, self._dmap_slots, self.slots)
            slots_sparse = active is not None
            if slots_sparse:
                self._log[m, 1].copy_(active[0])
        # the direct pairs' experts gathered into the buffer (wide loads over PCIe), direct
        # pair j's into buffer row rows[j] (its rank among the misses, < n_direct <= k), then
        # computed from there; with sparsity only the rows the sparse kernels read
        threshold = self._sparse_threshold(i)
        if threshold is not None:
            y_direct, active = self._sparse_direct(m, r, threshold)
            self._log[m, 2].copy_(active[0])
        else:
            gather_experts(self.direct[m], self._gathered_experts, ids, codes, self._rows_dev,
                           DIRECT)  # fmt: skip
            y_direct, _ = self.layers.routed_experts(i, r, self._dmap_direct,
                                                     self._gathered_experts, self.fmt)  # fmt: skip
        self._sparse[m] = (slots_sparse, threshold is not None)
        y = y_direct if y is None else y + y_direct
        if capturing:
            host_flags.absorb(self._flags_dev[1], self._seq, self._failed, m, y[0],
                              self._mapped_y_cpu, self._y_sum[0])  # fmt: skip
        else:
            self._y_sum.copy_(y + self.y_cpu.to(self.device))

    def _sparse_threshold(self, i: int) -> torch.Tensor | None:
        """Layer i's threshold where its direct pairs run sparse: whenever it has one, whatever
        the slots' switch measured in HBM (over PCIe every row not read is time saved); None
        for dense, and for the experts with biases or an activation only the generic kernels
        take (those gather whole experts and run the layer's own path)."""
        layers = self.layers
        if layers.expert_threshold is None:
            return None
        if generic_only(layers.blocks[i].expert_bias, layers.config.activation):
            return None
        return layers.expert_threshold[i]

    def _sparse_direct(self, m: int, r: Routed,
                       threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """MoE layer m's direct pairs, sparse (kernels.expert_gather): every neuron's gate row
        gathered, the gate dots and the mask from HBM, then only the kept neurons' up and down
        rows gathered and computed. Returns (y [1, n_embd] f32, active [1, k] int32)."""
        src, buf, dmap = self.direct[m], self._gathered_experts, self._dmap_direct
        ids, codes, rows = r.ids[0], self._log[m, 0], self._rows_dev
        gather_neuron_rows(src, buf, ids, codes, rows, DIRECT, (0, 1))
        gate = moe_gate(r.h, buf, self.fmt, r.ids, path="gemv", expert_map=dmap)  # [k, n_ff]
        idx, act, count = sparse_mask(gate, threshold, self.layers.config.activation,
                                      topk_ids=r.ids, expert_map=dmap)  # fmt: skip
        gather_neuron_rows(src, buf, ids, codes, rows, DIRECT, (1, 3), idx, count)
        y = moe_sparse_up_down(r.h, buf, self.fmt, r.ids, r.weights, idx, act, count,
                               expert_map=dmap)  # fmt: skip
        return y, count.view(1, -1)
