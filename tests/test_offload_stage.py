"""What a staged round costs the host (pyruntime.offload.slots, split): the launches it queues,
and the CPU's share handed to the worker thread where staging costs the host more than the
handoff, with the same logits as the whole model on the GPU."""

from __future__ import annotations

import pytest
import torch
from gpu_device import DEVICE
from launch_count import LaunchCounter
from test_offload import LOGPROB_TOL, N_DECODE, N_PROMPT, hybrid, ids_of, logprobs, max_err, tiny

from pyruntime.gpu.executor import GpuExecutor
from pyruntime.offload import executor as offload_executor
from pyruntime.offload.costs import Costs, measure_costs
from pyruntime.offload.segments import DecodeSegments

THRESHOLD = 0.05  # neuron sparsity on both sides (tests/test_offload.py's)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return tiny(tmp_path_factory, "olmoe")


@pytest.fixture(scope="module")
def olmoe_q8(tmp_path_factory):
    return tiny(tmp_path_factory, "olmoe", "q8_0")


def worker_costs(host) -> Costs:
    """A staged expert 0.1 ms, a CPU expert 0.2 ms, the host's queueing of a staged round
    0.1 ms, the handoff 10 us: a decode layer's two misses split one each side, the CPU's on
    the worker (0.21 ms, inline 0.3 ms); a prefill's too."""
    nbytes = next(b.experts for b in host.blocks if b.experts).expert_bytes
    return Costs(nbytes, nbytes / 1e5, 0.0, 2e-4, 0.0, 0.0, 0.0, 1e-4, 0.0, 1e-5)


def keep_slots(model) -> int:
    """Slots holding a token's experts in every MoE layer: below, they are transit slots."""
    _, cfg, host = model
    return sum(1 for b in host.blocks if b.experts is not None) * cfg.n_expert_used


@pytest.fixture(scope="module")
def reference(olmoe):
    """The whole model's log-probs on the GPU executor, dense and sparse."""
    _, cfg, host = olmoe
    torch.set_num_threads(1)
    ids = ids_of(cfg, N_PROMPT + N_DECODE, seed=4)
    out = {}
    for sparse in (False, True):
        ref = GpuExecutor(cfg, host, DEVICE)
        ref.set_expert_threshold([THRESHOLD] * cfg.n_layer if sparse else None)
        out[sparse] = logprobs(ref, ids)
    return ids, out


class Handoffs:
    """Counts the jobs handed to an executor's worker thread."""

    def __init__(self, net) -> None:
        self.count = 0
        worker = net.experts.worker
        if worker is not None:
            real = worker.submit

            def submit(fn):
                self.count += 1
                return real(fn)

            worker.submit = submit


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("slots", ["none", "transit", "cache"])
@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
def test_logits_equal_the_whole_model_with_the_worker_on_auto(olmoe, core, reference, misses,
                                                              slots, sparse,
                                                              monkeypatch):  # fmt: skip
    """The default worker choice ("auto") with costs under which a staging layer hands its CPU
    share to the worker: the whole model's logits at 0 slots, transit slots and a cache, every
    placement, dense and sparse; the worker runs only where a layer stages and has a CPU share
    (transit slots, auto: the cache does not charge the host's queueing, so it stays inline).
    Decode steps through the split, as where the direct step is unavailable (lookahead,
    input-weighted experts, a home the GPU cannot read in place)."""
    _, cfg, host = olmoe
    monkeypatch.setattr(offload_executor, "physical_cores", lambda: core.threads + 1)
    n = {"none": 0, "transit": keep_slots(olmoe) - 1, "cache": keep_slots(olmoe)}[slots]
    net = hybrid(olmoe, core, n, misses, costs=worker_costs(host))
    monkeypatch.setattr(net, "_direct_views", lambda: None)
    net.set_expert_threshold([THRESHOLD] * cfg.n_layer if sparse else None)
    handoffs = Handoffs(net)
    ids, want = reference
    assert max_err(logprobs(net, ids), want[sparse]) <= LOGPROB_TOL
    st = net.offload_stats()
    split = misses == "auto" and slots == "transit"
    if misses != "stage":  # staging every miss, a CPU share is only what no slot could take
        assert (handoffs.count > 0) == split
    if split:
        assert st["cpu_experts"] > 0 and st["staged_experts"] > 0
    net.close()


def test_never_and_always_fix_where_the_cpu_share_runs(olmoe, core, reference):
    _, cfg, host = olmoe
    ids, want = reference
    n = keep_slots(olmoe) - 1
    never = hybrid(olmoe, core, n, "auto", costs=worker_costs(host), cpu_thread=False)
    assert never.experts.worker is None
    assert max_err(logprobs(never, ids), want[False]) <= LOGPROB_TOL
    always = hybrid(olmoe, core, n, "cpu", costs=worker_costs(host), cpu_thread=True)
    handoffs = Handoffs(always)
    assert max_err(logprobs(always, ids), want[False]) <= LOGPROB_TOL
    assert handoffs.count == (1 + N_DECODE) * len(always.moe_layers())  # every layer's share
    always.close()
    assert hybrid(olmoe, core, 0, "cpu").experts.worker is None  # no slots: nothing to stage


def test_no_worker_by_default_beside_a_pool_on_every_core(olmoe, core, monkeypatch):
    """The default (cpu_thread None) keeps the CPU's share inline when the C pool has a thread
    on every physical core (a worker beside it oversubscribes the cores), and runs the worker
    where the pool leaves a core free."""
    _, _, host = olmoe
    n = keep_slots(olmoe) - 1
    monkeypatch.setattr(offload_executor, "physical_cores", lambda: core.threads)
    assert hybrid(olmoe, core, n, "auto", costs=worker_costs(host)).experts.worker is None
    monkeypatch.setattr(offload_executor, "physical_cores", lambda: core.threads + 1)
    net = hybrid(olmoe, core, n, "auto", costs=worker_costs(host))
    assert net.experts.worker is not None
    net.close()


# What one staged decode round queues outside the decode step's graphs (the GPU's share is one
# replay of its graph there), per staging batch (as many experts as a half of the staging ring
# holds): the copies of its experts (one call) and their repack into their slots (one launch),
# a mark after each and up to three waits (the ring half free, the copies landed, the slots'
# last readers done); per round, the compute stream's wait for the last repack and a mark after
# the kernel reading the slots. Before the fused repack a batch of b experts queued b copies, a
# cat and a slot copy (or an index upload and an index_copy_ where its slots were not
# consecutive; a zero fill more for mxfp4r).
LAUNCHES_PER_BATCH, MARKS_PER_BATCH, WAITS_PER_BATCH = 2, 2, 3


def test_a_staged_decode_round_queues_two_launches_a_batch(olmoe_q8, core, monkeypatch):
    _, cfg, host = model = olmoe_q8
    net = hybrid(model, core, keep_slots(model) - 1, "stage")
    rounds = []
    real_gpu = net.experts._gpu
    real_experts = DecodeSegments.gpu_experts
    counter = LaunchCounter()

    def replay(seg, m, slots):  # the graph's replay on a GPU: its launches are not the round's
        with counter.paused():
            return real_experts(seg, m, slots)

    calls = {"marks": 0, "waits": 0}
    streams = net.streams
    for name in ("mark_compute", "mark_copy", "mark_repack"):
        monkeypatch.setattr(streams, name, counting(getattr(streams, name), calls, "marks"))
    for name in ("compute_waits", "copy_waits", "repack_waits"):
        monkeypatch.setattr(streams, name, counting(getattr(streams, name), calls, "waits"))

    def gpu(i, r, plan, seg=None):
        staged = sum(len(placed) for _, _, placed in plan)
        calls.update(marks=0, waits=0)
        counter.counts.clear()
        with counter, counter.triton():
            y = real_gpu(i, r, plan, seg)
        if seg is not None and staged:
            rounds.append((staged, dict(counter.counts), dict(calls)))
        return y

    monkeypatch.setattr(DecodeSegments, "gpu_experts", replay)
    monkeypatch.setattr(net.experts, "_gpu", gpu)
    logprobs(net, ids_of(cfg, N_PROMPT + N_DECODE))
    assert rounds, "no decode round staged"
    half = net.slots._ring[0].shape[0]
    for staged, counts, marks in rounds:
        batches = -(-staged // half)
        assert sum(counts.values()) <= LAUNCHES_PER_BATCH * batches, counts
        assert counts.get("aten._foreach_copy", 0) == batches, counts
        assert marks["marks"] <= MARKS_PER_BATCH * batches + 1, marks
        assert marks["waits"] <= WAITS_PER_BATCH * batches + 1, marks


def counting(fn, calls: dict, key: str):
    def wrapped(*args, **kwargs):
        calls[key] += 1
        return fn(*args, **kwargs)

    return wrapped


def test_measured_costs_carry_the_handoff_where_there_is_a_worker(olmoe, core):
    """measure_costs on the executor's own pieces: the worker's round trip where the split may
    hand the CPU's share over, 0 where it never does (cpu_thread=False)."""
    n = keep_slots(olmoe) - 1
    measured = measure_costs(hybrid(olmoe, core, n, "cpu", cpu_thread=True), reps=2, tokens=2)
    assert measured.handoff_s > 0 and measured.host_round_s >= 0 and measured.pcie_gbs > 0
    inline = measure_costs(hybrid(olmoe, core, n, "cpu", cpu_thread=False), reps=2, tokens=2)
    assert inline.handoff_s == 0.0
