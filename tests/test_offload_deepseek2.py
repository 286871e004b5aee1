"""The hybrid executor (pyruntime.offload) on DeepSeek-V2: multi-head latent attention (its one
plane of latents and rope keys per layer, the absorbed decode) on the device beside the routed
experts split between GPU slots and the C core, with torch's CPU device standing in for the GPU
as in tests/test_offload.py.

The tiny model is deepseek-v2-lite's form (3 layers, the first dense, 8 routed experts top-2 with
routed_scaling_factor 1.5, 2 shared experts), and deepseek-v2's own (a query LoRA, the top-2
within the best of 2 groups). Its logits equal the GPU executor's with the whole model resident
(|d log-prob| <= 1e-3, the CPU's experts being the C core's; bit for bit where only the GPU
computes) for every budget and placement, dense and sparse, prefill then decode.
"""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import DEEPSEEK2_FULL
from test_offload import (
    DEVICE,
    LOGPROB_TOL,
    N_DECODE,
    N_PROMPT,
    SAME_KERNELS_TOL,
    check_sparse_experts_match,
    hybrid,
    ids_of,
    logprobs,
    max_err,
    n_routed,
    tiny,
)
from test_offload_qwen35 import capture_segments

from pyruntime.gpu.executor import GpuExecutor


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    return tiny(tmp_path_factory, "deepseek2", num_experts_per_tok=2)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A query LoRA and group-limited routing."""
    return tiny(tmp_path_factory, "deepseek2", num_experts_per_tok=2, **DEEPSEEK2_FULL)


@pytest.fixture(scope="module")
def whole(lite):
    """The GPU executor's log-probs with every expert resident (torch on one thread, as the
    hybrid sets it: see tests/test_offload.py's `whole`)."""
    torch.set_num_threads(1)
    _, cfg, host = lite
    ids = ids_of(cfg, N_PROMPT + N_DECODE)
    return ids, logprobs(GpuExecutor(cfg, host, DEVICE), ids)


def test_the_model_has_latent_attention_a_dense_first_layer_and_shared_experts(lite):
    _, cfg, host = lite
    assert cfg.is_mla and cfg.expert_weights_scale == 1.5 and cfg.n_expert_used == 2
    assert host.blocks[0].experts is None
    assert all(b.experts is not None and b.shared is not None for b in host.blocks[1:])


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
@pytest.mark.parametrize("slots", [0, 1, 5, "all"])
def test_logits_equal_the_whole_model_on_the_gpu(lite, core, whole, slots, misses):
    _, cfg, host = lite
    slots = n_routed(cfg, host) if slots == "all" else slots
    net = hybrid(lite, core, slots, misses)
    ids, want = whole
    got = logprobs(net, ids)
    st = net.offload_stats()
    assert max_err(got, want) <= LOGPROB_TOL
    if slots == 0 or misses == "cpu":
        assert st["staged_experts"] == 0 and st["cpu_experts"] > 0
    elif misses == "stage" and slots == n_routed(cfg, host):
        assert st["cpu_experts"] == 0
        assert max_err(got, want) <= SAME_KERNELS_TOL  # only the GPU's kernels, as resident
    elif misses == "auto" and slots >= 5 and net.experts.slots_keep:  # a cache: all staged
        assert st["cpu_experts"] == 0 and st["staged_experts"] > 0
    elif misses == "auto" and slots >= 5:  # transit slots
        assert st["cpu_experts"] > 0 and st["staged_experts"] > 0  # a split
    n_moe = len(net.moe_layers())
    assert n_moe == cfg.n_layer - 1
    assert net.stats.pairs == (N_PROMPT + N_DECODE) * cfg.n_expert_used * n_moe
    # its cache: one plane of latents (32) and rope keys (16) per layer
    assert [tuple(t.shape) for t in net.new_cache(9).kv] == [(1, 1, 9, 48)] * cfg.n_layer


def test_group_limited_routing_and_a_query_lora(full, core):
    _, cfg, host = full
    assert (cfg.mla_q_rank, cfg.expert_groups, cfg.expert_groups_used) == (64, 2, 1)
    ids = ids_of(cfg, N_PROMPT + N_DECODE, seed=3)
    want = logprobs(GpuExecutor(cfg, host, DEVICE), ids)
    for slots, misses in ((0, "cpu"), (5, "auto"), (n_routed(cfg, host), "stage")):
        got = logprobs(hybrid(full, core, slots, misses), ids)
        assert max_err(got, want) <= LOGPROB_TOL, (slots, misses)


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
def test_sparse_experts_match_on_both_sides(lite, core, misses):
    check_sparse_experts_match(lite, core, 5, misses, (0.1, 0.95))


def test_model_loads_hybrid_and_generates_the_cpu_executors_text(lite, monkeypatch, tmp_path,
                                                                 capsys):  # fmt: skip
    """pyruntime.Model under a plan that holds 3 of the 16 routed experts (on the CPU device
    standing in for the GPU): its costs are measured on the model and its greedy text is the
    CPU executor's."""
    from pyruntime import api, placement
    from pyruntime.api import Model
    from pyruntime.offload.plan import device_bytes, plan_budget

    f, cfg, _ = lite
    need = device_bytes(f, cfg, 64)
    plan = plan_budget(need, need.fixed + 3 * need.expert_bytes, 64)

    def greedy(m: Model) -> list[int]:
        stream = m.generate([5, 17, 300, 42, 9], max_tokens=6, temp=0, ignore_eos=True)
        list(stream)
        return stream.token_ids

    want = greedy(Model(f.path, n_ctx=64, seed=0, device="cpu"))
    monkeypatch.setattr(api, "choose_device",
                        lambda *a, **k: placement.DeviceChoice(DEVICE, None, plan))  # fmt: skip
    monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path / "cache"))
    m = Model(f.path, n_ctx=64, seed=0)
    assert "3 of 16 routed experts" in capsys.readouterr().err
    assert greedy(m) == want
    stats = m.stats()["offload"]
    assert stats["slots"] == 3 and stats["slot_hits"] + stats["slot_misses"] > 0


def test_captured_segments_equal_the_eager_step(lite, core, whole, monkeypatch):
    """Decode steps as captured segments (stood in on the CPU: tests/test_offload_qwen35.py's
    EagerGraph) read their position from the step's device inputs (latent plane) and
    equal the eager ones; the capture's warm-up run of each segment changes nothing."""
    captures = capture_segments(monkeypatch)
    net = hybrid(lite, core, 5, "auto")
    ids, want = whole
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    assert len(captures) >= len(net.moe_layers()) + 1  # the step's segments, the GPU's experts
