"""The hybrid executor (pyruntime.offload): a model bigger than the GPU, with torch's CPU device
standing in for the GPU (Triton kernels under the interpreter, streams and events as no-ops) and
the C core computing the CPU's experts.

Every budget from dense only (0 slots) to everything resident, every placement of the misses
(all on the CPU, all staged, split by costs), dense and sparse: the logits equal the GPU
executor's with the whole model resident (the same kernels) within the GPU-vs-CPU tolerance of
tests/test_gpu_model.py (f32 GGUF: |d log-prob| <= 1e-3; the CPU's experts are the C core's),
and bit for bit where only the GPU computes. Fake costs stand in for measured ones, chosen so
that a decode step's two misses go one to each side.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from gpu_device import DEVICE
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.core import CpuCore
from pyruntime.errors import DeviceMemoryError, PyruntimeWarning, UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.gpu.executor import GpuExecutor
from pyruntime.kernels.expert_formats import row_bytes
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.weights import HostWeights
from pyruntime.offload.costs import Costs
from pyruntime.offload.executor import HybridExecutor
from pyruntime.offload.split import DIRECT_RATE, STAGE_PASS_TOKENS, CpuWorker
from pyruntime.offload.step_graph import no_collection

LOGPROB_TOL = 1e-3
# Where only the GPU computes, the hybrid runs the resident model's kernels: bit for bit under
# the interpreter; on a GPU the expert kernels add their partial sums with relaxed atomics, whose
# order (and so the last bits of an f32 sum) changes from run to run.
SAME_KERNELS_TOL = 0.0 if DEVICE == "cpu" else 1e-5
# log-probs of two MXFP4 kernels whose activations differ: int8 blocks vs f32 (a random tiny
# gpt-oss moves by ~1e-2)
MXFP4_ACTIVATIONS_TOL = 2e-2
N_PROMPT, N_DECODE = 7, 4


def tiny(tmp_path_factory, arch: str, fmt: str = "f32", **hf):
    tmp = tmp_path_factory.mktemp(f"offload-{arch}-{fmt}")
    hf.setdefault("tie_word_embeddings", True)
    hf_dir = make_tiny_hf_model(arch, tmp / "hf", **hf)
    f = open_gguf(convert(hf_dir, tmp / "m.gguf", fmt, progress=False))
    cfg = ModelConfig.from_gguf(f)
    return f, cfg, HostWeights.from_gguf(f, cfg)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return tiny(tmp_path_factory, "olmoe")


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory):
    """A shared expert with its gate, and a dense-FFN layer."""
    return tiny(tmp_path_factory, "qwen2moe")


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """Expert biases by global id, the clamped SwiGLU, sinks and a sliding window; an untied
    embedding, as gpt-oss-20b's (in host memory in the hybrid)."""
    return tiny(tmp_path_factory, "gptoss", tie_word_embeddings=False)


def even_costs(host: HostWeights) -> Costs:
    """A staged expert and a CPU expert cost the same (1e-4 s): a layer's misses alternate
    between the two sides, the first to the CPU."""
    nbytes = next(b.experts for b in host.blocks if b.experts).expert_bytes
    return Costs(nbytes, nbytes / 1e5, 0.0, 1e-4, 0.0, 0.0, 0.0)


def n_routed(cfg: ModelConfig, host: HostWeights) -> int:
    return sum(cfg.n_expert for b in host.blocks if b.experts is not None)


def hybrid(model, core, slots: int, misses: str = "auto", **kw) -> HybridExecutor:
    f, cfg, host = model
    kw.setdefault("costs", even_costs(host))
    return HybridExecutor(cfg, host, DEVICE, core, slots=slots, misses=misses, **kw)


def ids_of(cfg: ModelConfig, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.n_vocab, (n,), generator=g).tolist()


def logprobs(net, ids: list[int]) -> torch.Tensor:
    """A prefill of N_PROMPT tokens, then one-token decode steps."""
    cache = net.new_cache(len(ids))
    parts = [net.forward(ids[:N_PROMPT], cache)]
    parts += [net.forward(ids[j : j + 1], cache) for j in range(N_PROMPT, len(ids))]
    return torch.log_softmax(torch.cat(parts).double(), dim=-1)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def whole(olmoe, qwen2moe):
    """Reference log-probs of the GPU executor with every expert resident, per model. With
    torch on one thread, as the hybrid sets it: on the CPU stand-in the "GPU" kernels are torch
    and Triton-interpreter ops whose sums split by thread count, and the comparison with the
    resident model's kernels is bit for bit (SAME_KERNELS_TOL)."""
    torch.set_num_threads(1)
    out = {}
    for name, (_, cfg, host) in (("olmoe", olmoe), ("qwen2moe", qwen2moe)):
        ids = ids_of(cfg, N_PROMPT + N_DECODE)
        out[name] = ids, logprobs(GpuExecutor(cfg, host, DEVICE), ids)
    return out


# -- every budget, every placement -------------------------------------------------------------


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
@pytest.mark.parametrize("slots", [0, 1, 3, "all"])
def test_logits_equal_the_whole_model_on_the_gpu(olmoe, core, whole, slots, misses):
    _, cfg, host = olmoe
    slots = n_routed(cfg, host) if slots == "all" else slots
    net = hybrid(olmoe, core, slots, misses)
    ids, want = whole["olmoe"]
    got = logprobs(net, ids)
    st = net.offload_stats()
    assert max_err(got, want) <= LOGPROB_TOL
    assert st["slot_hits"] + st["slot_misses"] > 0
    if slots == 0 or misses == "cpu":  # nothing can be staged, or nothing is
        assert st["staged_experts"] == 0 and st["slot_hits"] == 0 and st["cpu_experts"] > 0
    elif slots == n_routed(cfg, host):  # stage, and auto in a cache: every miss staged
        assert st["cpu_experts"] == 0 and st["evictions"] == 0
        assert max_err(got, want) <= SAME_KERNELS_TOL  # only the GPU's kernels, as resident
    elif misses == "auto" and slots == 3:  # transit slots
        assert st["cpu_experts"] > 0 and st["staged_experts"] > 0  # a split
    assert net.stats.pairs == (N_PROMPT + N_DECODE) * cfg.n_expert_used * 2  # 2 MoE layers


@pytest.mark.parametrize("n_direct", [None, 0, 1, 8])
@pytest.mark.parametrize("slots", [0, 3])
def test_direct_steps_equal_the_whole_model(olmoe, core, whole, slots, n_direct):
    """misses='direct': a decode step as one graph (run eagerly on the CPU stand-in), the GPU's
    share of each layer's misses read in place from host memory, the rest on the C core: the
    whole model's log-probs, every split of the misses."""
    _, cfg, host = olmoe
    net = hybrid(olmoe, core, slots, "direct")
    net.experts.n_direct = n_direct
    ids, want = whole["olmoe"]
    got = logprobs(net, ids)
    st = net.offload_stats()
    assert max_err(got, want) <= LOGPROB_TOL
    k = cfg.n_expert_used
    direct = sum(net.experts.direct_counts(k, 2))  # 2 MoE layers
    if n_direct is not None:
        assert direct == 2 * min(n_direct, k)
    if slots == 0:  # every pair of a decode step is a miss: direct ones, then the CPU's
        assert st["direct_experts"] == N_DECODE * direct
        assert st["direct_bytes"] == st["direct_experts"] * host.blocks[0].experts.expert_bytes
        assert st["cpu_experts"] >= N_DECODE * (2 * k - direct)
    assert net.stats.pairs == (N_PROMPT + N_DECODE) * k * 2  # the GPU's pairs counted too


def test_direct_counts_spread_a_fractional_share_over_the_layers(olmoe, core):
    net = hybrid(olmoe, core, 0, "direct")
    net.experts.n_direct = 2.5
    assert net.experts.direct_counts(8, 6) == [3, 2, 3, 2, 3, 2]
    net.experts.n_direct = 20
    assert net.experts.direct_counts(8, 3) == [8, 8, 8]
    net.experts.n_direct = None  # from the costs (even ones: the GPU at DIRECT_RATE the CPU's)
    assert sum(net.experts.direct_counts(8, 3)) == round(24 * DIRECT_RATE / (1 + DIRECT_RATE))


@pytest.mark.parametrize("tied", [True, False])
def test_a_q8_0_embedding_stays_quantized_in_the_hybrid(tmp_path_factory, core, tied):
    """A tied Q8_0 token_embd is one device tensor in the hybrid too (the lookup's Q8_0 rows,
    the lm_head's weights); an untied one stays in host memory (tests/test_offload_embedding.py).
    With every expert in a slot the hybrid runs the resident model's kernels, embedding and
    lm_head included."""
    model = tiny(tmp_path_factory, "olmoe", "q8_0", tie_word_embeddings=tied)
    _, cfg, host = model
    torch.set_num_threads(1)
    ids = ids_of(cfg, N_PROMPT + N_DECODE)
    want = logprobs(GpuExecutor(cfg, host, DEVICE), ids)
    net = hybrid(model, core, n_routed(cfg, host), "stage")
    e = net.weights.token_embd
    if tied:
        assert e.w is None and net.weights.output is e
    else:
        assert e is None and net.weights.output.w is None  # the lm_head: Q8_0 on the device
    assert max_err(logprobs(net, ids), want) <= SAME_KERNELS_TOL


@pytest.mark.parametrize("slots", [0, 3, 8])
def test_shared_expert_and_dense_layers(qwen2moe, core, whole, slots):
    net = hybrid(qwen2moe, core, slots, "auto")
    ids, want = whole["qwen2moe"]
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    assert net.moe_layers() == [0]


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto", "direct"])
@pytest.mark.parametrize("slots", [0, 3, "all"])
def test_gpt_oss_expert_biases_on_both_sides(gptoss, core, slots, misses):
    """gpt-oss: the experts' biases (by global id) and clamped SwiGLU on the GPU's slots and on
    the CPU's share alike: the whole model's log-probs at every budget and placement."""
    _, cfg, host = model = gptoss
    ids = ids_of(cfg, N_PROMPT + N_DECODE)
    want = logprobs(GpuExecutor(cfg, host, DEVICE), ids)
    slots = n_routed(cfg, host) if slots == "all" else slots
    assert max_err(logprobs(hybrid(model, core, slots, misses), ids), want) <= LOGPROB_TOL


def check_sparse_experts_match(model, core, slots: int, misses: str,
                               sparsity: tuple[float, float],
                               threshold: float = 0.05):  # fmt: skip
    """The same thresholds on the CPU and the GPU (`slots` experts on the GPU, the misses as
    `misses` places them): the GPU executor's logits and neuron counts, within the tolerance
    (a neuron at the threshold may flip between the two), the achieved sparsity inside the
    open interval `sparsity`, and the logits moved from the dense model's."""
    _, cfg, host = model
    thresholds = [threshold] * cfg.n_layer
    ref = GpuExecutor(cfg, host, DEVICE)
    ref.set_expert_threshold(thresholds)
    ids = ids_of(cfg, N_PROMPT + N_DECODE, seed=1)
    want = logprobs(ref, ids)
    net = hybrid(model, core, slots, misses)
    net.set_expert_threshold(thresholds)
    got = logprobs(net, ids)
    assert max_err(got, want) <= LOGPROB_TOL
    assert net.stats.pairs == ref.stats.pairs
    assert sparsity[0] < net.stats.sparsity < sparsity[1]
    assert abs(net.stats.sparsity - ref.stats.sparsity) < 0.02
    dense = logprobs(GpuExecutor(cfg, host, DEVICE), ids)
    assert max_err(got, dense) > 2 * LOGPROB_TOL  # the thresholds did skip neurons
    return net


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto", "direct"])
def test_sparse_experts_match_on_both_sides(olmoe, core, misses):
    check_sparse_experts_match(olmoe, core, 3, misses, (0.2, 0.9))


def test_no_collection_while_a_step_waits_on_the_host():
    """The direct step's replay runs with the cyclic collector off (a finalizer freeing
    page-locked memory would synchronize the device under a graph that waits for the host), and
    the collector's state is back after it, also when the step raises."""
    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), no_collection():
        raise KeyError("a failed step")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


def test_the_cpu_worker_runs_a_job_in_the_callers_inference_mode():
    """A job on the worker thread updates in place a tensor the caller made in inference mode
    (the step's host buffers), and sees the caller's mode, whichever it is."""
    worker = CpuWorker()
    try:
        with torch.inference_mode():
            out = torch.zeros(3)
            done = worker.submit(lambda: (out.add_(1.0), torch.is_inference_mode_enabled()))
            assert done()[1]
        assert torch.equal(out, torch.ones(3))
        assert not worker.submit(torch.is_inference_mode_enabled)()
    finally:
        worker.close()


def test_sparse_direct_steps_without_slots(olmoe, core):
    net = check_sparse_experts_match(olmoe, core, 0, "direct", (0.2, 0.9))
    # the direct pairs read every gate row but only the kept neurons' up and down rows
    st, expert_bytes = net.offload_stats(), olmoe[2].blocks[0].experts.expert_bytes
    assert st["direct_experts"] > 0
    whole = st["direct_experts"] * expert_bytes
    assert whole / 3 < st["direct_bytes"] < whole * (1 - 2 / 3 * 0.2)


def test_q8_0_experts_are_repacked_into_slots(tmp_path_factory, core):
    """Q8_0 experts are staged as GGUF blocks and repacked on the device: all staged, the
    logits are the resident model's (bit for bit under the interpreter); on the CPU (the C
    core's Q8 dots against the GPU's bf16 activations), within bf16's tolerance."""
    model = tiny(tmp_path_factory, "olmoe", "q8_0")
    _, cfg, host = model
    ids = ids_of(cfg, N_PROMPT + N_DECODE, seed=2)
    want = logprobs(GpuExecutor(cfg, host, DEVICE), ids)
    staged = hybrid(model, core, 5, "stage")
    assert staged.slots.format == "q8_0r"
    assert max_err(logprobs(staged, ids), want) <= SAME_KERNELS_TOL
    on_cpu = logprobs(hybrid(model, core, 0, "cpu"), ids)
    assert max_err(on_cpu, want) <= 2e-2
    assert torch.equal(on_cpu.argmax(-1), want.argmax(-1))


def test_mxfp4_experts_are_repacked_into_slots(tmp_path_factory, core):
    """gpt-oss's MXFP4 experts are staged as GGUF blocks and repacked on the device into mxfp4r
    slots (rows padded to 16 bytes): the resident model's logits (which read mxfp4r too), bit
    for bit under the interpreter, with the experts' biases and the clamped SwiGLU."""
    model = tiny(tmp_path_factory, "gptoss", "mxfp4")
    _, cfg, host = model
    ids = ids_of(cfg, N_PROMPT + N_DECODE, seed=3)
    whole = GpuExecutor(cfg, host, DEVICE)
    assert {b.experts_fmt for b in whole.weights.blocks if b.experts is not None} == {"mxfp4r"}
    want = logprobs(whole, ids)
    staged = hybrid(model, core, 5, "stage")
    assert staged.slots.format == "mxfp4r"
    assert staged.slots.tensor.shape[-1] == row_bytes("mxfp4r", cfg.n_embd)
    assert max_err(logprobs(staged, ids), want) <= SAME_KERNELS_TOL
    assert staged.offload.staged > 0
    # the direct step: hits in the mxfp4r slots, its GPU misses read as the GGUF's MXFP4 by the
    # generic kernel (f32 activations, where mxfp4r's dots take them as int8 blocks, as the C
    # core's do: its misses-on-the-CPU run differs from `want` by 1.0e-2 here, this one 0.9e-2)
    direct = hybrid(model, core, 3, "direct")  # transit slots: the prefill leaves misses
    direct.experts.n_direct = 8
    assert max_err(logprobs(direct, ids), want) <= MXFP4_ACTIVATIONS_TOL
    assert direct.offload.direct > 0


def test_auto_stages_every_miss_of_a_pass_of_32_tokens_or_more(olmoe, core):
    """Costs that send misses to the CPU (a CPU expert 10x cheaper than a staged one): a pass
    of a few tokens splits as they say; one of STAGE_PASS_TOKENS stages every miss."""
    _, cfg, host = olmoe
    nbytes = next(b.experts for b in host.blocks if b.experts).expert_bytes
    cheap_cpu = Costs(nbytes, nbytes / 1e5, 0.0, 1e-5, 0.0, 0.0, 0.0)
    for n, staged_only in ((7, False), (STAGE_PASS_TOKENS, True)):
        net = hybrid(olmoe, core, 3, "auto", costs=cheap_cpu)
        net.forward(ids_of(cfg, n), net.new_cache(n))
        assert (net.offload.cpu_experts == 0) == staged_only
        assert net.offload.staged > 0 or not staged_only


def test_a_prefill_stages_in_rounds_when_its_experts_outnumber_the_slots(olmoe, core, whole):
    _, cfg, host = olmoe
    ids, want = whole["olmoe"]
    net = hybrid(olmoe, core, 2, "stage")
    cache = net.new_cache(len(ids))
    got = [net.forward(ids[:N_PROMPT], cache)]
    assert net.offload.staged > 2 and net.offload.cpu_experts == 0  # more than the slots
    got += [net.forward(ids[j : j + 1], cache) for j in range(N_PROMPT, len(ids))]
    assert max_err(torch.log_softmax(torch.cat(got).double(), -1), want) <= LOGPROB_TOL


def test_a_repeated_prefill_hits_what_the_last_one_left_in_the_slots(tmp_path_factory, core):
    """A prefill uses every expert of every layer, layer by layer: its admissions evict by that
    sweep (pyruntime.offload.cache), so the next prefill finds all but the slots the misses
    cycle through (recency evicted just what it needed next: no hit at 60% in slots)."""
    model = tiny(tmp_path_factory, "olmoe", num_hidden_layers=6)
    _, cfg, host = model
    n_slots = round(0.6 * n_routed(cfg, host))
    net = hybrid(model, core, n_slots, "stage")
    ids = ids_of(cfg, 32, seed=4)
    hits = []
    for _ in range(3):
        before = net.cache.stats.hits
        net.forward(ids, net.new_cache(len(ids)), last_only=True)
        hits.append(net.cache.stats.hits - before)
    assert net.offload.cpu_experts == 0
    assert all(h >= n_slots - cfg.n_expert for h in hits[1:]), hits


def test_the_stats_keep_what_the_cost_model_expected_of_each_side(olmoe, core, whole):
    """Beside the C core's seconds, the cost model's for the same CPU shares and staged experts
    (even_costs: 1e-4 s an expert either side, nothing per call or token), in a pass the
    model splits: a prompt under STAGE_PASS_TOKENS in transit slots (their decode steps run
    direct)."""
    ids, _ = whole["olmoe"]
    net = hybrid(olmoe, core, 3, "auto")
    net.forward(ids[:N_PROMPT], net.new_cache(len(ids)))
    stats = net.offload
    assert stats.cpu_experts > 0 and stats.staged > 0
    assert stats.cpu_model_seconds == pytest.approx(1e-4 * stats.cpu_experts)
    assert stats.stage_model_seconds == pytest.approx(1e-4 * stats.staged)
    model = net.offload_stats()["model_seconds_per_token"]
    assert model["staging"] == pytest.approx(1e-4 * stats.staged / stats.tokens)


def test_the_cpus_share_of_a_prefill_goes_to_the_c_core_without_the_other_tokens(
    olmoe, core, monkeypatch
):
    """Tokens with no pair on the CPU are left out of the C core's call (it costs time per
    token): y is the C core's over all tokens, 0 on the tokens left out."""
    _, cfg, host = olmoe
    net = hybrid(olmoe, core, 3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, cfg.n_embd, generator=g)
    ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[: cfg.n_expert_used]
                       for _ in range(9)])  # fmt: skip
    ids[2] = torch.tensor([e for e in range(cfg.n_expert) if e not in (1, 4)][:2])
    w = torch.rand(9, cfg.n_expert_used, generator=g)
    emap = torch.full((cfg.n_expert,), -1, dtype=torch.int32)
    emap[[1, 4]] = torch.tensor([1, 4], dtype=torch.int32)
    store = host.blocks[1].experts
    want, want_active = core.moe_ffn(store.raw, int(store.qtype), store.n_expert, store.n_ff,
                                     store.n_embd, x, ids, w, cfg.activation,
                                     expert_map=emap)  # fmt: skip
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[5].shape[0])
        return CpuCore.moe_ffn(core, *args, **kwargs)

    monkeypatch.setattr(core, "moe_ffn", spy)
    got, active = net.cpu_experts(1, [1, 4], x, ids, w)
    assert torch.equal(got, want) and active == want_active
    assert not got[2].any() and calls == [int((emap[ids] >= 0).any(1).sum())] and calls[0] < 9


# -- prefetch, lookahead, routing -------------------------------------------------------------


def test_prefetch_stages_and_holds_until_the_next_pass_ends(olmoe, core, whole):
    ids, want = whole["olmoe"]
    net = hybrid(olmoe, core, 4, "cpu")  # misses are never staged: only prefetches fill slots
    cache = net.new_cache(len(ids))
    parts = [net.forward(ids[:N_PROMPT], cache)]
    for j in range(N_PROMPT, len(ids)):
        net.prefetch(0, [0, 1])
        net.prefetch(1, [2, 3, 4])  # the fifth finds every slot held
        assert net.cache.held == {(0, 0), (0, 1), (1, 2), (1, 3)}
        parts.append(net.forward(ids[j : j + 1], cache))
        assert net.cache.held == set()
    assert max_err(torch.log_softmax(torch.cat(parts).double(), -1), want) <= LOGPROB_TOL
    assert net.offload.prefetched == 4 and net.cache.stats.hits > 0
    net.prefetch(5, [0])  # not a MoE layer (the model has 2): nothing to do
    assert net.cache.held == set()


@pytest.mark.parametrize("misses", ["stage", "auto"])
def test_lookahead_stages_the_next_layers_experts_early(olmoe, core, whole, misses):
    """With staging cheaper than the CPU (auto stages what it predicts, as stage does)."""
    ids, want = whole["olmoe"]
    cheap = Costs(even_costs(olmoe[2]).expert_bytes, 1e3, 0.0, 1e-4, 0.0, 0.0, 0.0)
    net = hybrid(olmoe, core, 6, misses, lookahead=True, costs=cheap)
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    assert net.offload.prefetched > 0  # staged for layer 1 during layer 0's decode steps
    assert net.cache.held == set()


def test_auto_needs_costs_only_in_transit_slots(olmoe, core):
    """A cache stages every miss: auto runs there without measured costs; in transit slots it
    splits by them, and without them it is a one-line usage error."""
    _, cfg, host = olmoe
    keep = len([b for b in host.blocks if b.experts is not None]) * cfg.n_expert_used
    net = hybrid(olmoe, core, keep, "auto", costs=None)
    logprobs(net, ids_of(cfg, N_PROMPT + N_DECODE))
    assert net.offload.cpu_experts == 0 and net.offload.staged > 0
    with pytest.raises(UsageError, match="transit slots by measured costs"):
        hybrid(olmoe, core, keep - 1, "auto", costs=None)


def test_auto_splits_in_transit_slots_and_stages_every_miss_in_a_cache(olmoe, core):
    """A staged expert outlives its token only when the slots hold a token's experts in every
    MoE layer (a cache): there auto stages every miss, the CPU none; below that (transit slots)
    it splits by the costs, which charge each layer the host's queueing: with a queueing cost
    above what staging saves, transit slots stage nothing."""
    _, cfg, host = olmoe
    keep = len([b for b in host.blocks if b.experts is not None]) * cfg.n_expert_used
    slow_host = dataclasses.replace(even_costs(host), host_round_s=1.0)
    for slots, stages in ((keep - 1, False), (keep, True)):
        net = hybrid(olmoe, core, slots, "auto", costs=slow_host)
        assert net.experts.slots_keep == stages
        logprobs(net, ids_of(cfg, N_PROMPT + N_DECODE))
        stats = net.offload_stats()
        assert (stats["staged_experts"] > 0) == stages, slots
        assert (stats["cpu_experts"] == 0) == stages, slots


def test_resident_only_passes_drop_the_misses_and_move_no_bytes(olmoe, core, whole):
    """Inside resident_experts_only a decode step computes the routed experts in slots and
    drops the others: nothing staged, nothing on the CPU; with every expert in a slot it is the
    plain step; with some missing, another result. Outside it, the step is whole again."""
    _, cfg, host = olmoe
    ids, want = whole["olmoe"]
    every = hybrid(olmoe, core, n_routed(cfg, host), "stage")
    cache = every.new_cache(len(ids))
    every.forward(ids[:N_PROMPT], cache)  # stages every expert the prompt routes to
    for e in range(cfg.n_expert):  # and the rest: every expert in a slot
        for layer in every.experts.moe:
            every.experts.stage(layer, [e])
    with every.resident_experts_only():
        got = every.forward(ids[N_PROMPT : N_PROMPT + 1], cache)
    ref = torch.log_softmax(got.double(), -1)
    assert max_err(ref, want[N_PROMPT : N_PROMPT + 1]) <= LOGPROB_TOL

    few = hybrid(olmoe, core, 1, "auto")  # one slot: most of a step's experts miss
    cache = few.new_cache(len(ids))
    few.forward(ids[:N_PROMPT], cache)
    before = few.offload_stats()
    with few.resident_experts_only():
        dropped = few.forward(ids[N_PROMPT : N_PROMPT + 1], cache)
    after = few.offload_stats()
    assert after["staged_experts"] == before["staged_experts"]
    assert after["cpu_experts"] == before["cpu_experts"]
    assert max_err(torch.log_softmax(dropped.double(), -1), want[N_PROMPT : N_PROMPT + 1]) > 1e-3
    assert not few.experts.resident_only
    cache.truncate(N_PROMPT)
    whole_step = torch.log_softmax(few.forward(ids[N_PROMPT : N_PROMPT + 1], cache).double(), -1)
    assert max_err(whole_step, want[N_PROMPT : N_PROMPT + 1]) <= LOGPROB_TOL


def test_routing_trace_is_the_gpu_executors(olmoe, core):
    _, cfg, host = olmoe
    ref, net = GpuExecutor(cfg, host, DEVICE), hybrid(olmoe, core, 3)
    rc, nc = ref.new_cache(9), net.new_cache(9)
    ids = ids_of(cfg, 9, seed=3)
    for tokens in (ids[:6], ids[6:7], ids[7:8]):
        want, got = RoutingTrace(layers=[]), RoutingTrace(layers=[])
        ref.forward(tokens, rc, routing=want)
        net.forward(tokens, nc, routing=got)
        assert got.layers == want.layers == [0, 1]
        assert torch.equal(got.ids, want.ids)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("misses", "step"), [("auto", "direct"), ("cpu", "segments")])
@pytest.mark.parametrize("k", [1, 3])
def test_k_experts_per_call(olmoe, core, k, misses, step):
    """Fewer experts per token through either decode step (3 transit slots: auto decodes
    direct, the CPU's misses through the graph segments), each made once per k."""
    _, cfg, host = olmoe
    ids = ids_of(cfg, N_PROMPT + N_DECODE, seed=4)
    ref, net = GpuExecutor(cfg, host, DEVICE), hybrid(olmoe, core, 3, misses)
    cache_r, cache_n = ref.new_cache(len(ids)), net.new_cache(len(ids))
    for tokens in (ids[:N_PROMPT], *[[t] for t in ids[N_PROMPT:]]):
        want = torch.log_softmax(ref.forward(tokens, cache_r, k=k).double(), -1)
        got = torch.log_softmax(net.forward(tokens, cache_n, k=k).double(), -1)
        assert max_err(got, want) <= LOGPROB_TOL
    assert net.stats.pairs == len(ids) * k * 2
    key = ("direct", k) if step == "direct" else (k, False)
    assert list(cache_n.executor_state["hybrid"].segments) == [key]  # made once


# -- big/little through the hybrid ------------------------------------------------------------


def test_big_little_through_the_hybrid_equals_the_cpu_executor(tmp_path, core):
    """gamma = 0 (little only), gamma = 1 (big only) and greedy verify give the same tokens
    through the hybrid as through the CPU executor (prefetch stages the big pass's experts)."""
    from pyruntime.api import Model
    from pyruntime.cpu.executor import CpuExecutor

    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", num_experts_per_tok=4,
                            initializer_range=0.3)  # fmt: skip
    m = Model(convert(hf, tmp_path / "m.gguf", "f32", progress=False), n_ctx=64, device="cpu",
              expert_backend="torch", seed=0)  # fmt: skip
    cfg = m.config
    nets = {
        "cpu": CpuExecutor.from_gguf(m.file, expert_backend="torch"),
        "hybrid": HybridExecutor(
            cfg,
            HostWeights.from_gguf(m.file, cfg),
            DEVICE,
            core,
            slots=6,
            costs=Costs(1, 1.0, 0, 1, 0, 0, 0),
        ),  # fmt: skip
    }

    def tokens(net, **decoding) -> list[int]:
        m.net, m._session = net, None
        stream = m.generate([5, 17, 300, 42, 9], max_tokens=6, temp=0.0, ignore_eos=True,
                            **decoding)  # fmt: skip
        list(stream)
        return stream.token_ids

    for decoding in ({}, dict(experts_per_token=2), dict(little_experts=2, fallback_threshold=0.0),
                     dict(little_experts=2, fallback_threshold=1.0),
                     dict(little_experts=2, fallback="verify", draft=3)):  # fmt: skip
        assert tokens(nets["hybrid"], **decoding) == tokens(nets["cpu"], **decoding), decoding
    assert nets["hybrid"].offload.prefetched > 0  # the fallbacks' prefetches staged experts
    # drafts from the experts in slots only: greedy verify is still big-only decoding
    resident = dict(little_experts=2, fallback="verify", draft=3, draft_experts="resident")
    assert tokens(nets["hybrid"], **resident) == tokens(nets["cpu"])
    with pytest.raises(UsageError, match="--draft-experts resident .* running hybrid"):
        tokens(nets["cpu"], **resident)


# -- faults ----------------------------------------------------------------------------------


class RefusingPinning:
    def __init__(self) -> None:
        self.pinned: list[int] = []

    def pin(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        return "operation not permitted (RLIMIT_MEMLOCK)"

    def unpin(self, ptr: int) -> None:
        raise AssertionError("nothing was pinned")


@pytest.mark.parametrize("staging", ["register", "pinned"])
def test_a_refused_pin_warns_and_stages_through_bounce_buffers(olmoe, core, whole, staging):
    with pytest.warns(PyruntimeWarning, match="refused .*RLIMIT_MEMLOCK.*bounce buffers"):
        net = hybrid(olmoe, core, 3, "stage", staging=staging, pinning=RefusingPinning())
    assert net.home.mode == "bounce"
    ids, want = whole["olmoe"]
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    assert net.offload.staged > 0


def test_out_of_memory_while_running_is_one_line(olmoe, core, monkeypatch):
    net = hybrid(olmoe, core, 3)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(net.layers, "routed_experts", oom)
    with pytest.raises(DeviceMemoryError, match="ran out of memory while running") as err:
        net.forward([1, 2, 3], net.new_cache(4))
    assert "\n" not in str(err.value) and "--gpu-mem" in str(err.value)
    assert net.cache.held == set()


def test_the_cpus_share_on_a_worker_thread(olmoe, core, whole, monkeypatch):
    """cpu_thread: the same logits; a GPU failure mid-layer still collects the CPU's result,
    so the next pass pairs each layer with its own."""
    ids, want = whole["olmoe"]
    net = hybrid(olmoe, core, 3, "auto", cpu_thread=True)
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    assert net.offload.cpu_experts > 0 and net.offload.staged > 0
    real = net.layers.routed_experts

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(net.layers, "routed_experts", oom)
    with pytest.raises(DeviceMemoryError):
        net.forward(ids[:N_PROMPT], net.new_cache(len(ids)))
    monkeypatch.setattr(net.layers, "routed_experts", real)
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    net.close()
