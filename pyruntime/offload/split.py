"""One MoE layer's routed experts, split between the GPU's expert slots and the CPU.

`SplitExperts(i, r, k)` is the routed-experts piece of the hybrid executor's layer loop:

1. the layer's routing (top-k ids, weights) and its experts' input h come to the host: one
   small device-to-host copy and one wait, the pass's only host synchronization per layer;
2. ExpertCache.lookup: the routed experts in a slot (hits) and the others (misses);
   costs.split_misses divides the misses between the CPU and staging in transit slots; in a
   cache (slots_keep) and in a pass of STAGE_PASS_TOKENS every miss is staged (or misses = cpu
   | stage);
3. staged misses are admitted into slots (the policy frees them, never one of this layer's; a
   prefill's in its sweep order, pyruntime.offload.cache) and copied on the copy stream
   (pyruntime.offload.slots, ordered by events); the GPU computes hits and staged experts
   from the slot tensor through an expert map (kernels.dispatch), in rounds
   when a prefill stages more experts than there are free slots;
4. meanwhile the C core computes the CPU's share in place from host memory (CpuCore.moe_ffn with
   an expert map, dense or sparse with the same thresholds): on this thread once the GPU work is
   queued (inline), or on the worker thread, started before the GPU work is queued, so that
   queueing it overlaps the CPU's share at the price of a thread handoff (the C call releases
   the GIL). worker "auto" (the default where there are slots): per layer, whichever the cost
   model says finishes sooner (costs.split_misses: inline when the layer stages nothing, on the
   worker when its staging costs the host more than the handoff); "always" / "never" fix it
   (bench/offload.py --cpu-thread);
5. the CPU's partial sum is copied to the device and added to the GPU's.

`prefetch` stages experts ahead and holds them until the next pass ends; the lookahead stages
the next MoE layer's likely experts (its router applied to this layer's residual stream) while
this layer computes, held until that layer's lookup.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from pyruntime.cpu.core import CpuCore
from pyruntime.errors import UsageError
from pyruntime.gpu.layers import DecoderLayers, Routed
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import rms_norm
from pyruntime.model.stats import ExpertStats
from pyruntime.model.weights import HostWeights
from pyruntime.offload.cache import ExpertCache
from pyruntime.offload.costs import Costs, Split, read_share, split_misses
from pyruntime.offload.home import ExpertHome
from pyruntime.offload.segments import DecodeSegments, HybridStep
from pyruntime.offload.slots import ExpertSlots
from pyruntime.offload.stats import OffloadStats, PartTimer
from pyruntime.offload.step_graph import CPU, DIRECT, HOST_WAIT_S
from pyruntime.offload.streams import DeviceStreams

MISSES = ("auto", "cpu", "stage", "direct")
# direct: the share of a layer's misses the GPU reads in place from host memory, where no
# measured costs say otherwise (0 slots): 2 of olmoe's 8 a layer, the fastest split dense (and
# sparse, or tied) since the host's turns run in one C call, which made the CPU's share faster.
# 0 slots, tg128, 16 threads, one process each (bench/offload.py --misses direct --n-direct
# LIST --sparsity 0,0.5), tok/s of two rounds: H200 host, dense 139.7, 135.7 at 2 / 134.1,
# 134.5 at 2.25 / 127.8, 126.0 at 2.5 / 118.0, 127.3 at 2.75; sparsity 0.5 169.7, 171.2 /
# 163.1, 163.6 / 161.5, 160.0 / 156.4, 163.2. H100 host, dense 118.9, 130.2 at 2 / 114.1, 119.1
# at 2.5 / 116.8, 117.9 at 2.75; sparse 153.6, 147.9 / 151.8, 150.6 / 157.9, 149.2. At 2.75 the
# GPU's gathers (~41 GB/s over PCIe beside the CPU's reads) were the slower side (a kernel
# profile, H200 host).
DIRECT_SHARE = 0.25
# With measured costs, the in-place gather's rate over the costs' staging rate (a copy measured
# while the C core reads, 35-37 GB/s on the H200 host, where the gather reads at 45-50): fitted
# so that the costs of two H200 processes give 2.75-2.9 of 8 (the old 0.85 gave 2, which lost:
# 16 transit slots, tg64, 111.2 / 104.5 tok/s against 111.4 / 113.7 at 3). Measured again with
# the host's turns in one C call, H100 host, 16 transit slots (--misses auto -p 512 -n 128): 2
# (from 0.85) against 2.75, dense 117.2 / 112.9 tok/s, sparsity 0.5 129.0 / 146.0, 143.3: kept.
DIRECT_RATE = 1.36
# A pass of this many tokens or more stages every miss (llama.cpp moves a host expert's weights
# to the GPU for a batch of 32 tokens or more too): the cost model's CPU time, measured per pair
# at a few tokens, is off for batches (gpt-oss-20b MXFP4, pp512 at 60% of the experts in slots,
# H100 host: the C core took 6x what the model expected, auto 519 tok/s against all staged
# 3,231; olmoe-1b-7b Q8_0: auto 758-2,931 against 5,434).
STAGE_PASS_TOKENS = 32
# In a cache (slots_keep: the slots hold a token's experts in every MoE layer) every miss is
# staged too: a staged miss is admitted for later tokens and its copy runs beside the host,
# while a miss on the C core is neither and its inline call holds the thread that queues the
# next layers, which the split's model leaves out. olmoe-1b-7b Q8_0, H200 host, tg64, auto
# (the split) / stage in the same process, two processes: 12.5% of the experts in slots 78.8 / 130.7
# and 59.1 / 99.2 tok/s, 25% 238.6 / 249.9 and 161.7 / 200.8, sparsity 0.5 129.2 / 124.5 and
# 232.2 / 238.8 (bench/offload.py --fractions 0.125,0.25 --misses auto,stage); gpt-oss-20b at
# 8G (67% in slots, H100): the split with the C core taking ~2/3 of the misses 75.0-100.0
# against 87.3-100.7 with ~1/7. The split stays for transit slots.
IN_SEGMENT = object()  # _gpu's answer when a decode step's graph computed the GPU's share
Key = tuple[int, int]  # (layer, expert)


class SplitExperts:
    def __init__(self, cfg: ModelConfig, host: HostWeights, layers: DecoderLayers,
                 streams: DeviceStreams, home: ExpertHome, slots: ExpertSlots,
                 cache: ExpertCache, core: CpuCore, stats: ExpertStats,
                 offload: OffloadStats, timer: PartTimer) -> None:  # fmt: skip
        self.config, self.host, self.layers, self.streams = cfg, host, layers, streams
        self.home, self.slots, self.cache, self.core = home, slots, cache, core
        self.stats, self.offload, self.timer = stats, offload, timer
        self.moe = [i for i, b in enumerate(host.blocks) if b.experts is not None]
        self.next_moe = dict(zip(self.moe, self.moe[1:], strict=False))
        first = host.blocks[self.moe[0]].experts
        self.fmt, self.expert_bytes = int(first.qtype), first.expert_bytes
        self.misses, self.costs = "cpu", None
        self.lookahead = False
        self.threshold: list[float] | None = None  # per layer, the CPU's (the GPU's: layers)
        self.prefetch_holds: set[Key] = set()  # until the next pass ends
        self.lookahead_holds: set[Key] = set()  # until their layer's lookup
        self.cpu_active = [0, 0]  # neurons the CPU kept, of those it considered
        self.worker: CpuWorker | None = None  # runs the CPU's share beside this thread
        self.worker_always = False  # every CPU share on the worker (else: the split decides)
        self.resident_only = False  # misses dropped (HybridExecutor.resident_experts_only)
        self.n_direct: float | None = None  # misses='direct': misses a layer's GPU reads in
        # place, on average (None: from the costs; direct_counts)

    def set_misses(self, misses: str, costs: Costs | None) -> None:
        if misses not in MISSES:
            raise UsageError(f"misses must be one of {', '.join(MISSES)}, got {misses!r}")
        if misses == "auto" and self.slots.n_slots and not self.slots_keep and costs is None:
            raise UsageError("misses='auto' splits misses in transit slots by measured costs: "
                             "give costs (pyruntime.offload.costs.measure_costs)")  # fmt: skip
        self.misses, self.costs = misses, costs

    def __call__(self, i: int, r: Routed, trace: list | None) -> torch.Tensor:
        """y [n, n_embd] f32 on the device: layer i's routed experts for a pass of several
        tokens (module doc); trace gets the last token's (ids, router logits) on the host."""
        t = time.perf_counter()
        parts = [r.ids, r.weights, r.h32]
        if trace is not None:
            parts.append(r.logits[-1])
        host = [self.streams.to_host(p) for p in parts]
        self.streams.host_waits()
        self.offload.route_wait_seconds += time.perf_counter() - t
        ids, weights, h = host[0], host[1], host[2].float()
        if trace is not None:
            trace.append((ids[-1].clone(), host[-1].clone()))
        experts, n_tokens = np.unique(ids.numpy(), return_counts=True)
        y, y_cpu = self._layer(i, r, experts.tolist(), n_tokens.tolist(), h, ids, weights)
        if y_cpu is not None:
            y_cpu = self.streams.to_device(y_cpu)
            y = y_cpu if y is None else y.add_(y_cpu)
        return y

    def decode(self, i: int, r: Routed, seg: DecodeSegments, trace: list | None) -> None:
        """Layer i's routed experts for one token, its segment's routing in seg's host buffers
        (the host waited for them): the GPU's share into seg.y_gpu, the CPU's into seg.y_cpu
        (pyruntime.offload.segments); trace gets (ids, router logits) on the host."""
        used = seg.ids[0].tolist()  # k distinct experts, one token each
        if trace is not None:
            trace.append((seg.ids[0].long(), seg.router_logits[0].clone()))
        ahead = self.next_moe.get(i) if self.lookahead else None
        predicted = seg.predicted.tolist() if ahead is not None else None
        y, y_cpu = self._layer(i, r, used, [1] * len(used), seg.h, seg.ids, seg.weights,
                               ahead, predicted, seg.y_cpu, seg)  # fmt: skip
        if y is not IN_SEGMENT:
            seg.set_gpu_share(y)
        seg.set_cpu_share(y_cpu is not None)

    def _layer(self, i: int, r: Routed, used: list[int], counts: list[int], h: torch.Tensor,
               ids: torch.Tensor, weights: torch.Tensor, ahead: int | None = None,
               predicted: list[int] | None = None, out: torch.Tensor | None = None,
               seg: DecodeSegments | None = None):  # fmt: skip
        """(the GPU's y on the device, None, or IN_SEGMENT when it is in seg.y_gpu; the CPU's
        y on the host or None) of layer i's experts `used`, counts[j] tokens routed to used[j];
        h, ids, weights: the layer's routing on the host; ahead, predicted: the lookahead's
        next layer and its likely experts; out: where the C core writes its y; seg: a decode
        step's segments, whose graph computes the GPU's share when it is one round."""
        self.release({key for key in self.lookahead_holds if key[0] == i})
        missed = set(self.cache.lookup(i, used))
        hits = [e for e in used if e not in missed]
        if self.resident_only:  # the misses are dropped: no copy, no CPU work
            missed, ahead = set(), None
        misses = [(e, n) for e, n in zip(used, counts, strict=True) if e in missed]
        cpu, stage, on_worker = self.place(misses, len(hits), graph=seg is not None,
                                           n_tokens=ids.shape[0])  # fmt: skip
        # A pass whose routes can reach every expert of a layer (a prefill) sweeps the cache
        # layer by layer: its admissions evict by that order (ExpertCache.admit).
        sweep = seg is None and ids.numel() >= self.config.n_expert
        rounds, left = self._admit_rounds(i, hits, stage, sweep)
        cpu += left
        if self.costs is not None:  # what the cost model expects of this layer's two sides
            n_of = dict(zip(used, counts, strict=True))
            staged = [e for round_ in rounds for e, _ in round_[2]]
            self.offload.cpu_model_seconds += self.costs.cpu_seconds([n_of[e] for e in cpu],
                                                                     self._read())  # fmt: skip
            self.offload.stage_model_seconds += self.costs.stage_seconds([n_of[e] for e in staged])
        job = self._start_cpu(i, cpu, h, ids, weights, out, on_worker, seg) if cpu else None
        try:
            y = self._gpu(i, r, rounds, seg)
            if ahead is not None:
                self._look_ahead(i, ahead, predicted, used)
        except BaseException:
            if job is not None:  # the worker's result must not be left for the next layer
                with contextlib.suppress(BaseException):
                    job()
            raise
        if job is None:
            return y, None
        y_cpu, n_active, seconds = job()
        self.offload.cpu_seconds += seconds
        on_cpu = set(cpu)
        n_pairs = sum(n for e, n in zip(used, counts, strict=True) if e in on_cpu)
        self._count_cpu(len(cpu), n_pairs, n_active)
        return y, y_cpu

    def place(self, misses: list[tuple[int, int]], n_hits: int, graph: bool = False,
              n_tokens: int = 1) -> Split:  # fmt: skip
        """(CPU experts, staged experts, whether the CPU's share goes to the worker) of one
        layer's misses [(expert, tokens)], when n_hits of the slots hold this layer's hits
        (graph: a decode step's, whose GPU share is a graph replay, not an eager launch) in a
        pass of n_tokens. With every miss staged (misses='stage', or 'auto' at STAGE_PASS_TOKENS
        or more, or in a cache: slots_keep), a CPU share (experts no slot could take) goes to
        the worker, beside the queueing of the rounds; auto splits by the cost model in
        transit slots only."""
        always = self.worker is not None and self.worker_always
        mode = self.misses
        if mode == "direct":  # outside a direct decode step (a prefill): as auto, where it can
            mode = "auto" if self.costs is not None else "cpu"
        if not misses or self.slots.n_slots <= n_hits or mode == "cpu":
            return Split([e for e, _ in misses], [], always)
        if mode == "stage" or (mode == "auto" and (n_tokens >= STAGE_PASS_TOKENS
                                                   or self.slots_keep)):  # fmt: skip
            return Split([], [e for e, _ in misses], self.worker is not None)
        worker = "never" if self.worker is None else "always" if always else "auto"
        split = split_misses(misses, self.costs, self._read(), worker=worker,
                             launch=not n_hits and not graph)  # fmt: skip
        return split._replace(on_worker=split.on_worker or always)

    def _read(self) -> float:
        """The share of an expert's bytes the CPU reads, at the sparsity it achieved so far."""
        kept = self.cpu_active[0] / self.cpu_active[1] if self.cpu_active[1] else 1.0
        return read_share(1.0 - kept)

    @property
    def slots_keep(self) -> bool:
        """Whether a staged expert can stay for later tokens: the slots hold a token's experts
        in every MoE layer (else they are transit slots, refilled layer after layer)."""
        return self.slots.n_slots >= len(self.moe) * self.config.n_expert_used

    # -- the GPU's share --------------------------------------------------------------------------

    def _admit_rounds(self, i: int, hits: list[int], stage: list[int],
                      sweep: bool = False) -> tuple[list, list[int]]:  # fmt: skip
        """([(experts, their slots, those to copy in)] per round, the staged experts no slot
        could take): the slots are assigned now (bookkeeping only), the copies and kernels
        issued by _gpu. Staged experts go in rounds of at most half the slots this layer's hits
        leave when they do not fit at once, so a round's copies can run while the previous
        round computes (a copy into a slot waits for the kernels that read it). sweep: a
        prefill's admissions (ExpertCache.admit)."""
        hit_slots = [self.cache.residency.slot(i, e) for e in hits]
        if not stage:
            return ([(hits, hit_slots, [])] if hits else []), []
        room = self.slots.n_slots - len(hits)
        size = len(stage) if len(stage) <= room else max(1, room // 2)
        rounds, left, previous = [], [], []
        for j in range(0, len(stage), size):
            chunk = stage[j : j + size]
            placed = self._admit(i, chunk, protect=hits + previous + chunk, sweep=sweep)
            left += chunk[len(placed) :]
            first = not rounds
            experts = (hits if first else []) + [e for e, _ in placed]
            slots = (hit_slots if first else []) + [slot for _, slot in placed]
            if experts:
                rounds.append((experts, slots, placed))
            previous = [e for e, _ in placed]
        return rounds, left

    def _gpu(self, i: int, r: Routed, rounds: list, seg: DecodeSegments | None = None):
        """y of the rounds' experts (None without any; IN_SEGMENT: one round, computed by
        seg's graph into seg.y_gpu): each round's copies, then its kernel. On a failure, the
        experts admitted for rounds whose copies never started leave their slots (the
        bookkeeping must not claim bytes that are not there)."""
        y, filled = None, 0
        try:
            for experts, slots, placed in rounds:
                self._fill(i, placed)
                filled += 1
                if seg is not None and len(rounds) == 1:
                    self._round_in_segment(i, experts, slots, seg)
                    return IN_SEGMENT
                y_round = self._round(i, r, experts, slots)
                y = y_round if y is None else y.add_(y_round)
        except BaseException:
            for _, _, placed in rounds[filled:]:
                for e, _ in placed:
                    self.cache.drop(i, e)
            raise
        return y

    def _round(self, i: int, r: Routed, experts: list[int], slots: list[int]) -> torch.Tensor:
        """y of `experts` (in `slots`) from the slot tensor, once their copies landed."""
        emap = self.streams.host_tensor((self.config.n_expert,), torch.int32)
        view = emap.numpy()
        view.fill(-1)
        view[experts] = slots
        dmap = self.streams.to_device(emap)
        mark = self.timer.start()
        self.slots.wait_ready(slots)
        mark = self.timer.stop("copy_wait", mark)
        y, active = self.layers.routed_experts(i, r, dmap, self.slots.tensor)
        self.timer.stop("gpu_experts", mark)
        self.slots.mark_read(slots)
        self.stats.add_device(active, dmap[r.ids], self.config.n_ff_exp)
        return y

    def _round_in_segment(self, i: int, experts: list[int], slots: list[int],
                          seg: DecodeSegments) -> None:  # fmt: skip
        """_round as the decode step's graph (DecodeSegments.gpu_experts), into seg.y_gpu."""
        view = seg.emap.numpy()
        view.fill(-1)
        view[experts] = slots
        mark = self.timer.start()
        self.slots.wait_ready(slots)
        mark = self.timer.stop("copy_wait", mark)
        active, mapped = seg.gpu_experts(seg.moe.index(i), self.slots.tensor)
        self.timer.stop("gpu_experts", mark)
        self.slots.mark_read(slots)
        self.stats.add_device(active, mapped, self.config.n_ff_exp)

    def _admit(self, i: int, experts: Sequence[int], protect: Sequence[int] = (),
               hold: bool = False, sweep: bool = False) -> list[tuple[int, int]]:  # fmt: skip
        """[(expert, slot)] of `experts` of layer i given a slot now (in order, up to the first
        that finds none: every slot protected or held); those already resident are skipped.
        hold: keep each resident until the next pass ends (a prefetch); sweep: a prefill's
        admissions (ExpertCache.admit)."""
        placed = []
        for e in experts:
            if self.cache.residency.slot(i, e) < 0:
                slot = self.cache.admit(i, e, protect=protect, sweep=sweep)
                if slot < 0:
                    break
                placed.append((e, slot))
            if hold:  # at once, so the next admissions cannot evict it
                self.prefetch_holds.add((i, e))
                self.cache.held.add((i, e))
        return placed

    def _fill(self, i: int, placed: list[tuple[int, int]]) -> None:
        """Start the copies of layer i's placed experts into their slots."""
        if placed:
            self.slots.fill([slot for _, slot in placed],
                            self.home.sources([(i, e) for e, _ in placed]))  # fmt: skip
            self.offload.staged += len(placed)
            self.offload.staged_bytes += len(placed) * self.expert_bytes

    def stage(self, i: int, experts: Sequence[int], protect: Sequence[int] = (),
              hold: bool = False) -> list[int]:  # fmt: skip
        """Admit `experts` of layer i into slots and start their copies now; returns those
        copied (see _admit)."""
        placed = self._admit(i, experts, protect, hold)
        try:
            self._fill(i, placed)
        except BaseException:
            for e, _ in placed:
                self.cache.drop(i, e)
            raise
        return [e for e, _ in placed]

    def release(self, keys: set[Key]) -> None:
        """Let `keys` be evicted again."""
        if keys:
            self.cache.held.difference_update(keys)
            self.prefetch_holds.difference_update(keys)
            self.lookahead_holds.difference_update(keys)

    def _predict(self, j: int, r: Routed, k: int) -> torch.Tensor:
        """Layer j's likely top-k for the last token: its router on this layer's residual
        stream (after attention), normed with layer j's FFN norm."""
        blk = self.layers.blocks[j]
        h = rms_norm(r.x[-1:].float(), blk.ffn_norm, self.config.rms_eps)
        return torch.topk(h @ blk.router.T, k, dim=-1).indices[0]

    def _look_ahead(self, i: int, j: int, predicted: list[int], in_use: list[int]) -> None:
        """Stage the predicted experts of layer j that the split would stage, held until layer
        j's lookup; layer i's experts in use stay (their kernels are queued)."""
        missing = [(e, 1) for e in predicted if self.cache.residency.slot(j, e) < 0]
        stage = self.place(missing, 0).stage
        if not stage:
            return
        keep = {(i, e) for e in in_use} - self.cache.held
        self.cache.held |= keep
        try:
            placed = self.stage(j, stage, protect=predicted)
        finally:
            self.cache.held -= keep
        keys = {(j, e) for e in placed}
        self.lookahead_holds |= keys
        self.cache.held |= keys
        self.offload.prefetched += len(placed)

    # -- a direct decode step (pyruntime.offload.step_graph) -------------------------------------

    def direct_counts(self, k: int, n_layers: int) -> list[int]:
        """Misses each MoE layer's GPU reads in place in a direct step, x a layer on average:
        x = n_direct if set, else the share of k the GPU's in-place read rate gives beside the
        CPU's (measured costs, else DIRECT_SHARE); a fractional x alternates between its two
        neighbours layer by layer (2.5: 3, 2, 3, 2, ...)."""
        if self.n_direct is not None:
            x = float(self.n_direct)
        else:
            share = DIRECT_SHARE
            c = self.costs
            if c is not None and c.pcie_gbs > 0 and c.cpu_expert_s > 0:
                gpu = c.pcie_gbs * DIRECT_RATE
                cpu = c.expert_bytes / c.cpu_expert_s / 1e9
                share = gpu / (gpu + cpu)
            x = k * share
        x = max(0.0, min(float(k), x))
        return [math.floor((j + 1) * x + 0.5) - math.floor(j * x + 0.5) for j in range(n_layers)]

    def direct_cpu_share(self, m: int, graph, trace: list | None, count: bool = True) -> None:
        """The host's part of MoE layer m in a direct step (StepGraph.cpu_share): the pairs the
        graph coded CPU, on the C core into graph.y_cpu; the cache's and the stats' counts
        (count: False for a graph capture's warm-up run, which the replay repeats)."""
        i = self.moe[m]
        ids = graph.ids.numpy()[0]
        codes = graph.codes.numpy()[0]
        cpu = ids[codes == CPU].tolist()
        if count:
            if trace is not None:
                trace.append((graph.ids[0].long(), graph.router_logits[0].clone()))
            if self.slots.n_slots:  # the policy's clock and the hit counts
                self.cache.lookup(i, ids.tolist())
            n_direct = int((codes == DIRECT).sum())
            # the GPU's pairs; their kept neurons are counted after the step (counts)
            self.stats.add_pairs(len(codes) - len(cpu), self.config.n_ff_exp)
            self.offload.direct += n_direct  # their bytes: counted by the graph (counts)
        if not cpu:
            graph.y_cpu.zero_()
            return
        t = time.perf_counter()
        n_active = self._decode_call(i, cpu, graph)
        if count:
            self.offload.cpu_seconds += time.perf_counter() - t
            self._count_cpu(len(cpu), len(cpu), n_active)

    def direct_host_step(self, graph, trace: list | None, seq: int) -> float:
        """The host's turns of a replayed direct step (StepGraph.host_step): every MoE layer's
        CPU share in one C call (CpuCore.bind_host_step, bound once to the graph's buffers),
        then what direct_cpu_share counts per layer, from the call's logs of the routing.
        Returns the seconds the host waited for the graph's signals."""
        thresholds = [None if self.threshold is None else self.threshold[i] for i in self.moe]
        views = [self.home.cpu_view(i) for i in self.moe]
        bound = graph.cpu_calls.get("step")
        if (
            bound is None
            or bound[0] != thresholds
            or any(a is not b for a, b in zip(bound[1], views, strict=True))
        ):
            cfg, blocks = self.config, self.host.blocks
            first = blocks[self.moe[0]].experts
            layers = [(view, t, blocks[i].experts.bias_pair) for i, view, t in
                      zip(self.moe, views, thresholds, strict=True)]  # fmt: skip
            call = self.core.bind_host_step(
                layers, self.fmt, first.n_expert, first.n_ff, first.n_embd,
                (graph.h, graph.ids, graph.weights, graph.codes), graph.y_cpu, graph.flags, CPU,
                cfg.activation, first.swiglu, graph.router_logits, HOST_WAIT_S,
            )  # fmt: skip
            bound = graph.cpu_calls["step"] = (thresholds, views, call)
        call = bound[2]
        waited, computed = call(seq)
        self._count_direct_step(call, trace)
        self.offload.cpu_seconds += computed
        return waited

    def _count_direct_step(self, call, trace: list | None) -> None:
        """direct_cpu_share's counts for a whole step, from the host step's logs."""
        ids, codes, n_active = call.ids_log, call.codes_log, call.n_active
        cpu = codes == CPU
        if trace is not None:
            for m in range(len(self.moe)):
                trace.append((torch.from_numpy(ids[m]).long(),
                              torch.from_numpy(call.logits_log[m].copy())))  # fmt: skip
        if self.slots.n_slots:  # the policy's clock and the hit counts, layer by layer
            for m, i in enumerate(self.moe):
                self.cache.lookup(i, ids[m].tolist())
        n_cpu = int(cpu.sum())
        self.stats.add_pairs(codes.size - n_cpu, self.config.n_ff_exp)
        self.offload.direct += int((codes == DIRECT).sum())
        if n_cpu:
            self._count_cpu(n_cpu, n_cpu, int(n_active.sum()))

    # -- the CPU's share --------------------------------------------------------------------------

    def _start_cpu(self, i: int, experts: list[int], h: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor | None, on_worker: bool,
                   seg: DecodeSegments | None = None):  # fmt: skip
        """A callable giving (y on the host, neurons kept, seconds) of layer i's CPU share: run
        when called (inline: after the GPU work is queued), or (on_worker) started now on the
        worker thread while this thread queues the GPU work. seg: a decode step's segments,
        whose buffers (h, ids, weights, out) the layer's bound C call reads."""

        def run():
            t = time.perf_counter()
            if seg is not None and not self.config.expert_input_weight:
                y, n_active = out, self._decode_call(i, experts, seg)
            else:
                y, n_active = self.cpu_experts(i, experts, h, ids, weights, out)
            return y, n_active, time.perf_counter() - t

        if self.worker is None or not on_worker:
            return run
        return self.worker.submit(run)

    def cpu_experts(self, layer: int, experts: Sequence[int], x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:  # fmt: skip
        """(y [T, n_embd] f32 in a host tensor a copy to the device may read (`out` when
        given), neurons kept) of the pairs of ids [T, k] routed to `experts`, on the C core
        from host memory. Only the tokens with such a pair go to the C core: its call costs
        time per token whether or not the token has a pair here (a prefill's CPU share is
        mostly experts with few tokens each)."""
        cfg = self.config
        emap = np.full(cfg.n_expert, -1, dtype=np.int32)
        emap[list(experts)] = experts
        if out is None:
            out = self.streams.host_tensor((x.shape[0], cfg.n_embd), torch.float32)
        threshold = None if self.threshold is None else self.threshold[layer]
        store = self.host.blocks[layer].experts

        def core_call(x, ids, weights, out):
            return self.core.moe_ffn(
                self.home.cpu_view(layer), self.fmt, store.n_expert, store.n_ff, store.n_embd,
                x, ids, weights, cfg.activation, threshold, out=out,
                expert_map=torch.from_numpy(emap), bias=store.bias_pair, swiglu=store.swiglu,
            )  # fmt: skip

        def call(x, ids, weights, out):
            if cfg.expert_input_weight:
                return input_weighted_call(core_call, x, ids, weights, out)
            return core_call(x, ids, weights, out)

        if x.shape[0] > 1:
            rows = np.flatnonzero((emap[ids.numpy()] >= 0).any(axis=1))
            if len(rows) < x.shape[0]:
                index = torch.from_numpy(rows)
                y, n_active = call(x[index], ids[index], weights[index], None)
                out.zero_()
                out[index] = y
                return out, n_active
        return call(x, ids, weights, out)

    def _decode_call(self, layer: int, experts: Sequence[int], seg: HybridStep) -> int:
        """cpu_experts for one decode token into seg.y_cpu, through the layer's C call bound to
        seg's buffers (CpuCore.bind_moe: its checks and marshalling once per layer, not once per
        token); returns the neurons kept."""
        threshold = None if self.threshold is None else self.threshold[layer]
        view = self.home.cpu_view(layer)
        bound = seg.cpu_calls.get(layer)
        if bound is None or bound[0] != threshold or bound[1] is not view:
            cfg, store = self.config, self.host.blocks[layer].experts
            emap = torch.full((cfg.n_expert,), -1, dtype=torch.int32)
            call = self.core.bind_moe(
                view, self.fmt, store.n_expert, store.n_ff, store.n_embd, seg.h, seg.ids,
                seg.weights, seg.y_cpu, emap, cfg.activation, threshold,
                bias=store.bias_pair, swiglu=store.swiglu,
            )  # fmt: skip
            bound = seg.cpu_calls[layer] = (threshold, view, call, emap.numpy())
        _, _, call, emap = bound
        emap.fill(-1)
        emap[list(experts)] = experts
        return call()

    def _count_cpu(self, n_experts: int, n_pairs: int, n_active: int) -> None:
        neurons = n_pairs * self.config.n_ff_exp
        self.stats.add(n_pairs, n_active, self.config.n_ff_exp)
        self.cpu_active[0] += n_active
        self.cpu_active[1] += neurons
        share = read_share(1.0 - n_active / neurons) if neurons else 1.0
        self.offload.cpu_experts += n_experts
        self.offload.cpu_bytes += int(n_experts * self.expert_bytes * share)


def input_weighted_call(call, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        out: torch.Tensor | None) -> tuple[torch.Tensor, int]:  # fmt: skip
    """llama4's routed experts on the C core (model.llama4.input_weighted_experts): each of a
    token's k pairs a row of its own, x [T, n_embd] times the pair's weight with weight 1, the
    k rows' outputs summed. call(x, ids, weights, out) is the C core's moe_ffn; a pair not
    computed there (the expert map) leaves its row 0. One row per token at top-1, the
    released models' k."""
    n_tokens, k = ids.shape
    xs = (x[:, None, :] * weights[:, :, None]).reshape(n_tokens * k, x.shape[1])
    ones = torch.ones(n_tokens * k, 1)
    if k == 1:
        return call(xs, ids, ones, out)
    y, n_active = call(xs, ids.reshape(n_tokens * k, 1), ones, None)
    y = y.view(n_tokens, k, -1).sum(dim=1)
    if out is None:
        return y, n_active
    out.copy_(y)
    return out, n_active


class CpuWorker:
    """One thread that runs the CPU's share of a layer while the caller queues the GPU's (the
    C core's call releases the GIL). `submit(fn)` returns a callable that waits for fn's
    result (re-raising its exception). fn runs in the caller's inference mode (a thread-local
    of torch's: the step's host buffers are inference tensors, which fn updates in place)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pyruntime-cpu-experts",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, inference = job
            try:
                with torch.inference_mode(inference):
                    self._results.put((fn(), None))
            except BaseException as exc:  # handed to the caller
                self._results.put((None, exc))

    def submit(self, fn):
        self._jobs.put((fn, torch.is_inference_mode_enabled()))

        def result():
            value, exc = self._results.get()
            if exc is not None:
                raise exc
            return value

        return result

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
