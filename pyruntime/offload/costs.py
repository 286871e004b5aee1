"""Where a missed expert is computed: the cost model, its measurement, and the split it decides.

For each (layer, expert) a pass needs that is not in a GPU slot (a miss), the hybrid either
computes it on the CPU (the C core reads its bytes from host memory) or stages it (copies it
into a slot over PCIe, then the GPU computes it). Both sides run at once, so a layer's misses
are split to finish together (docs/offloading.md has the model with its constants):

    cpu(S)   = c_call + sum over e in S of r * (c_expert + n_e * c_pair)
    stage(S) = sum over e in S of (B / beta + g_expert + n_e * g_pair)
    host(S)  = h_round + |S| * h_expert [+ h_launch]   (S staged; 0 when nothing is)

n_e: tokens of the pass routed to e; B: an expert's bytes; beta: the staging rate (GB/s);
r: the share of an expert's bytes the CPU reads, 1 dense, (1 + 2 (1 - s)) / 3 at neuron
sparsity s (gate rows always, up and down rows of the kept neurons); host(S): the host's time
queueing the staged experts (their copies, repack, marks), and the expert kernel's eager launch
h_launch where staging is what launches it (no hits, no decode graph). Where the C core runs:
- inline (on the thread that queues the staging, after it): a split layer takes
  host(S) + max(cpu, stage);
- on the worker thread (pyruntime.offload.split.CpuWorker), started before the staging is
  queued: max(w_handoff + cpu, host(S) + stage), w_handoff the thread handoff's round trip.
`split_misses` orders the misses by cpu / stage time and stages the prefix of that order that
makes the layer finish soonest, inline, on the worker, or (worker="auto") whichever of the two
finishes sooner for that prefix: a layer that stages nothing runs its CPU share inline (no
handoff), one whose staging costs the host more than the handoff hands the CPU share to the
worker. Decode (n_e = 1) splits in proportion to the two rates when the host's queueing is
cheap beside them, and stays on the CPU when it is not; a prefill's experts with many tokens go
to the GPU (their CPU cost grows with n_e, their staging cost hardly does). The executor
splits by this model only in transit slots (too few to keep a token's experts in every layer):
in a cache it stages every miss, which measured faster than any split (a staged expert's later
hits, and an inline C call's hold on the host, are outside this model:
pyruntime.offload.split, STAGE_PASS_TOKENS).

The constants are measured once per machine, model shape and staging mode (`measure_costs`,
at start-up) and cached as JSON in options.cache_dir()/offload; tests give their own.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from pyruntime.errors import PyruntimeWarning


@dataclass(frozen=True)
class Costs:
    """Seconds of the work a miss can take, on one machine for one model shape."""

    expert_bytes: int  # B: one routed expert
    pcie_gbs: float  # beta: staging rate, GB/s, measured while the CPU computes experts
    cpu_call_s: float  # c_call: one CPU expert call (handoff, h and y across)
    cpu_expert_s: float  # c_expert: reading one expert's bytes (dense), during staging
    cpu_pair_s: float  # c_pair: one (token, expert) pair's arithmetic on the CPU
    gpu_expert_s: float  # g_expert: one staged expert on the GPU, beyond its copy
    gpu_pair_s: float  # g_pair: one (token, expert) pair on the GPU
    host_round_s: float = 0.0  # h_round: host time queueing a staged round (its copies'
    # call, the repack's launch, marks and waits), beyond its experts'
    host_expert_s: float = 0.0  # h_expert: host time queueing one staged expert's copy
    handoff_s: float = 0.0  # w: a job's round trip through the CPU worker thread
    gpu_launch_s: float = 0.0  # h_launch: host time launching the expert kernel eagerly

    def host_seconds(self, n_staged: int, launch: bool = False) -> float:
        """host(S) of n_staged experts; launch: the round's kernel is launched for them (eagerly:
        no hit of the layer would launch it anyway, and no graph replay does)."""
        if not n_staged:
            return 0.0
        return self.host_round_s + n_staged * self.host_expert_s + (self.gpu_launch_s if launch
                                                                      else 0.0)  # fmt: skip

    def cpu_seconds(self, n_tokens: Sequence[int], read: float = 1.0) -> float:
        if not n_tokens:
            return 0.0
        return self.cpu_call_s + read * sum(self.cpu_expert_s + n * self.cpu_pair_s
                                            for n in n_tokens)  # fmt: skip

    def stage_seconds(self, n_tokens: Sequence[int]) -> float:
        copy = self.expert_bytes / (self.pcie_gbs * 1e9) if self.pcie_gbs > 0 else float("inf")
        return sum(copy + self.gpu_expert_s + n * self.gpu_pair_s for n in n_tokens)


def read_share(sparsity: float) -> float:
    """The share of an expert's bytes the CPU reads at neuron sparsity s (the gate rows
    always, the up and down rows of the kept neurons)."""
    return (1.0 + 2.0 * (1.0 - sparsity)) / 3.0


WORKER = ("never", "always", "auto")  # where split_misses may put the CPU's share


class Split(NamedTuple):
    cpu: list[int]  # experts the C core computes
    stage: list[int]  # experts staged into slots
    on_worker: bool  # the CPU's share runs on the worker thread (else inline)


def split_misses(misses: Sequence[tuple[int, int]], costs: Costs, read: float = 1.0,
                 capacity: int | None = None, worker: str = "never",
                 launch: bool = False) -> Split:  # fmt: skip
    """The split of one layer's misses [(expert, n_tokens)] that finishes first: the misses in
    order of how much more the CPU would take than staging (cpu / stage time), a prefix of that
    order staged and the rest on the CPU, the prefix whose layer finishes soonest (module doc;
    worker: the CPU's share inline, on the worker thread, or "auto": whichever finishes sooner,
    inline when nothing is staged; launch: staging makes the host launch the expert kernel
    eagerly, Costs.host_seconds) (ties: the shorter
    prefix, which evicts less; inline, which hands nothing over); at most `capacity` staged
    (None: no limit). Optimal when an expert may be split between the sides, within one
    expert's time of it otherwise. One token each (decode): the misses split in proportion to
    the two sides' rates; many (prefill): those with many tokens staged."""
    if worker not in WORKER:
        raise ValueError(f"worker must be one of {WORKER}, got {worker!r}")
    copy = costs.stage_seconds([0])
    jobs = []
    for e, n in misses:
        c = read * (costs.cpu_expert_s + n * costs.cpu_pair_s)
        g = copy + n * costs.gpu_pair_s
        jobs.append((c / g if g > 0 else float("inf"), e, c, g))
    jobs.sort(key=lambda j: -j[0])
    limit = len(jobs) if capacity is None else min(len(jobs), max(0, capacity))
    t_cpu = sum(c for _, _, c, _ in jobs)
    always = worker == "always" and bool(jobs)
    best, best_worker = 0, always
    best_time = t_cpu + (costs.cpu_call_s if jobs else 0.0) + (costs.handoff_s if always else 0.0)
    t_stage = 0.0
    for p in range(1, limit + 1):
        _, _, c, g = jobs[p - 1]
        t_cpu -= c
        t_stage += g
        host = costs.host_seconds(p, launch)
        if p == len(jobs):  # nothing left for the CPU
            finish, on_worker = host + t_stage, False
        else:
            cpu = t_cpu + costs.cpu_call_s
            inline = host + max(t_stage, cpu)
            handed = max(costs.handoff_s + cpu, host + t_stage)
            on_worker = worker == "always" or (worker == "auto" and handed < inline)
            finish = handed if on_worker else inline
        if finish < best_time:
            best, best_time, best_worker = p, finish, on_worker
    return Split([e for _, e, _, _ in jobs[best:]], [e for _, e, _, _ in jobs[:best]],
                 best_worker)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Measurement


def _median_seconds(fn: Callable[[int], None], reps: int) -> float:
    times = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _solve(a: float, b: float, c: float, m: int, t: int) -> tuple[float, float, float]:
    """(call, per expert, per pair) >= 0 from the times of (1 expert, 1 token) = a,
    (m experts, 1 token) = b and (m experts, t tokens each) = c."""
    pair = max(0.0, (c - b) / (m * (t - 1)))
    expert = max(0.0, (b - a) / (m - 1) - pair)
    call = max(0.0, a - expert - pair)
    return call, expert, pair


def measure_costs(hybrid, reps: int = 5, tokens: int = 16) -> Costs:
    """Measure the constants on this machine with the hybrid executor's own pieces (its C
    core, expert home, slots and GPU layers), on the model's real experts: CPU expert calls
    of 1 and m experts at 1 token and of m experts at `tokens` tokens; a batch of experts
    staged into slots while the CPU computes (both rates under the contention they meet in a
    split layer); the GPU's expert kernel over staged slots at 1 and `tokens` tokens."""
    cfg, home = hybrid.config, hybrid.home
    m = min(max(2, cfg.n_expert_used), cfg.n_expert)
    layers = hybrid.moe_layers()
    # Each call reads other experts than the calls before it (rotating over the layers and
    # their experts), so its bytes come from DRAM, not from a cache.
    groups = []
    for r in range(3 * reps + 16):
        layer = layers[r % len(layers)]
        first = (r // len(layers)) * m % cfg.n_expert
        groups.append((layer, [(first + j) % cfg.n_expert for j in range(m)]))
    for layer, experts in groups:  # fault the pages in (from disk on a cold start)
        for e in experts:
            hybrid.core.mem_read(home.cpu_view(layer)[e])
    x = torch.randn(tokens, cfg.n_embd)
    turn = iter(range(1 << 30))

    def cpu_call(n_exp: int, n_tok: int) -> None:
        layer, experts = groups[next(turn) % len(groups)]
        ids = torch.tensor([experts[:n_exp]] * n_tok)
        hybrid.cpu_experts(layer, experts[:n_exp], x[:n_tok], ids,
                           torch.full((n_tok, n_exp), 1.0 / n_exp))  # fmt: skip

    a = _median_seconds(lambda _: cpu_call(1, 1), reps)
    b = _median_seconds(lambda _: cpu_call(m, 1), reps)
    c = _median_seconds(lambda _: cpu_call(m, tokens), reps)
    call, expert, pair = _solve(a, b, c, m, tokens)
    keys = [(layer, e) for layer, experts in groups for e in experts]
    pcie, busy = _staging_rate(hybrid, keys, lambda: cpu_call(m, 1), reps)
    if busy is not None:  # the CPU's expert time while the copy engine also reads DRAM
        expert *= max(1.0, busy / b)
    g_expert, g_pair, launch = _gpu_expert_times(hybrid, m, tokens, reps)
    h_round, h_expert = _host_fill_times(hybrid, keys, reps)
    return Costs(home.expert_bytes, pcie, call, expert, pair, g_expert, g_pair, h_round,
                 h_expert, _handoff_seconds(hybrid, reps), launch)  # fmt: skip


def _batch(hybrid) -> int:
    """Experts per measured staging batch: 4 m (m = max(2, top-k)), as many as the slots hold."""
    return min(hybrid.slots.n_slots, 4 * max(2, hybrid.config.n_expert_used))


def _staging_rate(hybrid, keys, cpu_call, reps: int) -> tuple[float, float | None]:
    """(staging GB/s, median CPU call seconds meanwhile or None) of up to 4 m experts staged
    into slots while the CPU runs expert calls (on a CPU device: one after the other)."""
    slots, streams = hybrid.slots, hybrid.streams
    n = _batch(hybrid)
    if n == 0:
        return 0.0, None
    rates, busy = [], []
    for r in range(reps):
        batch = [keys[(r * n + j) % len(keys)] for j in range(n)]
        streams.host_waits()
        t = time.perf_counter()
        slots.fill(list(range(n)), hybrid.home.sources(batch))
        done = slots.ready_mark(range(n))
        if done is not None:  # the copies run while the CPU computes
            while not done.event.query():
                t0 = time.perf_counter()
                cpu_call()
                busy.append(time.perf_counter() - t0)
            done.event.synchronize()
        rates.append(n * slots.expert_bytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates), (statistics.median(busy) if busy else None)


def _host_fill_times(hybrid, keys, reps: int) -> tuple[float, float]:
    """(seconds per round beyond its experts, per expert) the host takes to queue experts'
    copies into slots (their sources, copies, repack: ExpertSlots.fill), from fills of 1 and
    of up to 4 m experts, each started with the device idle."""
    slots, streams = hybrid.slots, hybrid.streams
    n = _batch(hybrid)
    if n == 0:
        return 0.0, 0.0

    def fill(count: int, r: int) -> float:
        batch = [keys[(r * n + j) % len(keys)] for j in range(count)]
        streams.host_waits()
        t = time.perf_counter()
        slots.fill(list(range(count)), hybrid.home.sources(batch))
        seconds = time.perf_counter() - t
        streams.host_waits()
        return seconds

    one = statistics.median(fill(1, r) for r in range(reps))
    if n == 1:
        return one, 0.0
    per = max(0.0, (statistics.median(fill(n, r) for r in range(reps)) - one) / (n - 1))
    return max(0.0, one - per), per


def _handoff_seconds(hybrid, reps: int) -> float:
    """Median round trip of an empty job through the executor's CPU worker thread (0 without
    one: the CPU's share is then always inline)."""
    worker = hybrid.experts.worker
    if worker is None:
        return 0.0

    def round_trip(_: int) -> None:
        worker.submit(lambda: None)()

    return _median_seconds(round_trip, 4 * reps)


def _gpu_expert_times(hybrid, m: int, tokens: int, reps: int) -> tuple[float, float, float]:
    """(seconds per expert, per pair, the host's launch of one call) of the GPU's expert
    kernel over slots 0..m-1."""
    n = min(m, hybrid.slots.n_slots)
    if n == 0:
        return 0.0, 0.0, 0.0
    (one, launch), (many, _) = (hybrid.time_gpu_experts(n, t, reps) for t in (1, tokens))
    pair = max(0.0, (many - one) / (n * (tokens - 1)))
    return max(0.0, one / n - pair), pair, launch


# ---------------------------------------------------------------------------------------------
# Cache


def costs_key(**parts: object) -> str:
    return json.dumps(parts, sort_keys=True)


def load_or_measure(key: str, directory: Path, measure: Callable[[], Costs],
                    announce: Callable[[Path], None] | None = None) -> Costs:  # fmt: skip
    """The costs cached under `key` in `directory`, else measured now and cached (an
    unwritable folder: measured and used, with a warning)."""
    path = directory / f"costs-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return Costs(**saved["costs"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    if announce is not None:
        announce(path)
    costs = measure()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "costs": asdict(costs)}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        warnings.warn(
            f"cannot cache the measured offload costs in {directory} ({exc.strerror}):"
            " they will be measured again next time",
            PyruntimeWarning,
            stacklevel=2,
        )
    return costs
