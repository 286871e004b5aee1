"""The hybrid executor (pyruntime.offload) on Llama-4: experts whose sigmoid routing weight
scales their INPUT, on the GPU's slots (layers.routed_experts, as for resident experts) and on
the C core (pyruntime.offload.split.input_weighted_call: the weight applied to x per pair), the
shared expert and the interleaved dense-FFN layers on the GPU, chunked attention and NoPE layers
with temperature from the GPU executor; torch's CPU device stands in for the GPU as in
tests/test_offload.py.

The tiny model (tests/hf_fixtures.py) has 4 layers, MoE at 1 and 3 (4 experts, top-1, a shared
expert), dense FFNs at 0 and 2, NoPE at 1 and 3, chunks of 8 tokens; its logits equal the GPU
executor's with the whole model resident (|d log-prob| <= 1e-3, the CPU's experts being the C
core's; bit for bit where only the GPU computes) for every budget and placement, dense and
sparse, prefill then decode past a chunk boundary, and at top-2 (each pair its own input).
"""

from __future__ import annotations

import pytest
import torch
from test_offload import (
    DEVICE,
    LOGPROB_TOL,
    N_PROMPT,
    SAME_KERNELS_TOL,
    check_sparse_experts_match,
    hybrid,
    ids_of,
    max_err,
    n_routed,
    tiny,
)
from test_offload_qwen35 import capture_segments

from pyruntime.gpu.executor import GpuExecutor
from pyruntime.model.llama4 import input_weighted_experts
from pyruntime.model.reference import moe_ffn_torch
from pyruntime.offload.split import input_weighted_call

N_TOKENS = 12  # a prompt of N_PROMPT (7), then decode steps past the first chunk (8 tokens)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return tiny(tmp_path_factory, "llama4")


def logprobs(net, ids: list[int], k: int | None = None) -> torch.Tensor:
    """A prefill of N_PROMPT tokens, then one-token decode steps, at k experts a token."""
    cache = net.new_cache(len(ids))
    parts = [net.forward(ids[:N_PROMPT], cache, k=k)]
    parts += [net.forward(ids[j : j + 1], cache, k=k) for j in range(N_PROMPT, len(ids))]
    return torch.log_softmax(torch.cat(parts).double(), dim=-1)


@pytest.fixture(scope="module")
def whole(llama4):
    """The GPU executor's log-probs with every expert resident, at top-1 and top-2 (torch on
    one thread, as the hybrid sets it: see tests/test_offload.py's `whole`)."""
    torch.set_num_threads(1)
    _, cfg, host = llama4
    ids = ids_of(cfg, N_TOKENS)
    net = GpuExecutor(cfg, host, DEVICE)
    return ids, {k: logprobs(net, ids, k) for k in (1, 2)}


def test_the_model_has_input_weighted_experts_shared_experts_and_dense_layers(llama4):
    _, cfg, host = llama4
    assert cfg.expert_input_weight and cfg.n_expert_used == 1 and cfg.attention_chunk == 8
    assert [b.experts is not None for b in host.blocks] == [False, True, False, True]
    assert all(b.shared is not None for b in host.blocks if b.experts is not None)


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
@pytest.mark.parametrize("slots", [0, 1, 3, "all"])
def test_logits_equal_the_whole_model_on_the_gpu(llama4, core, whole, slots, misses):
    _, cfg, host = llama4
    slots = n_routed(cfg, host) if slots == "all" else slots
    net = hybrid(llama4, core, slots, misses)
    ids, want = whole
    got = logprobs(net, ids)
    st = net.offload_stats()
    assert max_err(got, want[1]) <= LOGPROB_TOL
    if slots == 0 or misses == "cpu":
        assert st["staged_experts"] == 0 and st["cpu_experts"] > 0
    elif misses == "stage" and slots == n_routed(cfg, host):
        assert st["cpu_experts"] == 0
        assert max_err(got, want[1]) <= SAME_KERNELS_TOL  # only the GPU's kernels, as resident
    assert net.stats.pairs == N_TOKENS * cfg.n_expert_used * len(net.moe_layers())


@pytest.mark.parametrize("on_worker", [False, True])
@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
def test_two_experts_a_token_each_weight_its_own_input(llama4, core, whole, misses, on_worker):
    """At k=2 a token's two pairs scale its input by their own weights, on both sides (the
    even costs put one of a decode step's two misses on each, in a transit slot); the CPU's
    share inline or on the worker thread (where it sums its pairs into the step's buffer)."""
    _, cfg, host = llama4
    ids, want = whole
    net = hybrid(llama4, core, 1, misses, cpu_thread=on_worker or None)
    got = logprobs(net, ids, k=2)
    assert max_err(got, want[2]) <= LOGPROB_TOL
    assert max_err(got, want[1]) > 10 * LOGPROB_TOL  # k=2 is another model
    st = net.offload_stats()
    if misses != "stage":
        assert st["cpu_experts"] > 0
    if misses != "cpu":
        assert st["staged_experts"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_cpu_share_weights_each_pairs_input_as_the_reference(llama4, core, k):
    """input_weighted_call on the C core equals model.llama4.input_weighted_experts on the
    torch experts at odd shapes, with some experts left to the other side (expert map)."""
    _, cfg, host = llama4
    layer = 1
    store = host.blocks[layer].experts
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, cfg.n_embd, generator=g)
    ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:k] for _ in range(5)])
    w = torch.rand(5, k, generator=g)
    here = [0, 2]  # the CPU's experts; 1 and 3 are elsewhere
    emap = torch.full((cfg.n_expert,), -1, dtype=torch.int32)
    emap[here] = torch.tensor(here, dtype=torch.int32)
    gud = store.raw  # [n_expert, n_ff, 3, row], as the hybrid's home hands it to the C core

    def call(x, ids, weights, out):
        return core.moe_ffn(gud, int(store.qtype), store.n_expert, store.n_ff, store.n_embd,
                            x, ids, weights, cfg.activation, out=out,
                            expert_map=emap)  # fmt: skip

    out = torch.full((5, cfg.n_embd), 7.0)
    y, n_active = input_weighted_call(call, x, ids.int(), w, out)
    kept = torch.isin(ids, torch.tensor(here))
    want, _ = input_weighted_experts(moe_ffn_torch, store, x, ids, w * kept, cfg.activation,
                                     None)  # fmt: skip
    assert y is out
    assert n_active == int(kept.sum()) * store.n_ff
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
def test_sparse_experts_match_on_both_sides(llama4, core, misses):
    # the tiny model's gates are wide: a threshold of 0.3 skips ~40% of the neurons
    check_sparse_experts_match(llama4, core, 3, misses, (0.1, 0.95), threshold=0.3)


def test_captured_segments_equal_the_eager_step(llama4, core, whole, monkeypatch):
    """Decode steps as captured segments (stood in on the CPU: tests/test_offload_qwen35.py's
    EagerGraph) read their position from the step's device inputs (NoPE temperature and chunk
    window) and equal the eager ones; the capture's warm-up run of each segment changes
    nothing."""
    captures = capture_segments(monkeypatch)
    net = hybrid(llama4, core, 5, "auto")
    ids, want = whole
    assert max_err(logprobs(net, ids), want[1]) <= LOGPROB_TOL
    assert len(captures) >= len(net.moe_layers()) + 1  # the step's segments, the GPU's experts
