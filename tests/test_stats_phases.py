"""Sparsity is reported for prefill and decode apart (pyruntime.model.stats): the counts of a
forward pass go to its phase (several tokens: prefill; one: decode), host and device counts
alike; totals sum both; the CPU executor, Model.stats() and the CLI's line show each phase."""

from __future__ import annotations

import argparse

import pytest
import torch
from hf_fixtures import make_tiny_hf_model

from pyruntime.cli.common import sparsity_report
from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf
from pyruntime.model.stats import ExpertStats


def test_counts_go_to_the_phase_of_their_pass():
    s = ExpertStats()
    s.begin("prefill")
    s.add(n_pairs=10, n_active=100, n_ff=40)  # 400 neurons, 100 active: 0.75 skipped
    s.begin("decode")
    s.add(n_pairs=2, n_active=64, n_ff=40)  # 80 neurons, 64 active: 0.2 skipped
    s.add_device(torch.tensor([8, 8]), torch.tensor([0, -1]), n_ff=40)  # 1 pair, 16 active
    assert s.phase_sparsity("prefill") == pytest.approx(0.75)
    assert s.phase_sparsity("decode") == pytest.approx(1 - 80 / 120)
    assert (s.pairs, s.neurons, s.active) == (13, 520, 180)
    assert s.sparsity == pytest.approx(1 - 180 / 520)
    s.reset()
    assert s.phase_sparsity("prefill") is None and s.phase_sparsity("decode") is None
    with pytest.raises(ValueError):
        s.begin("verify")


def test_the_cpu_executor_counts_prefill_and_decode_apart(tmp_path):
    hf_dir = make_tiny_hf_model("olmoe", tmp_path / "hf")
    path = convert(hf_dir, tmp_path / "m.gguf", "q8_0", progress=False)
    for backend in ("c", "torch"):
        net = CpuExecutor.from_gguf(open_gguf(path), expert_backend=backend)
        cfg = net.config
        net.expert_threshold = [0.02] * cfg.n_layer
        cache = net.new_cache(12)
        ids = torch.arange(10)
        net.forward(ids, cache, last_only=True)
        prefill = net.stats.phase_sparsity("prefill")
        assert net.stats.phase_sparsity("decode") is None
        assert net.stats.pairs == 10 * cfg.n_layer * cfg.n_expert_used
        net.expert_threshold = [0.0] * cfg.n_layer  # decode dense: its phase says so
        net.forward([3], cache)
        net.forward([4], cache)
        assert net.stats.phase_sparsity("decode") == 0.0, backend
        assert net.stats.phase_sparsity("prefill") == prefill and 0.0 < prefill < 1.0
        assert net.stats.pairs == 12 * cfg.n_layer * cfg.n_expert_used


def test_the_report_line_names_both_phases():
    class FakeModel:
        sparsity = 0.5
        achieved_sparsity = 0.6

        def sparsity_by_phase(self):
            return {"prefill": 0.17, "decode": 0.85}

    line = sparsity_report(FakeModel())
    assert line == " | expert sparsity: target 0.50, achieved 0.600 (prefill 0.170, decode 0.850)"
    assert sparsity_report(argparse.Namespace(sparsity=0.0)) == ""


def test_the_report_says_where_decode_ran_dense():
    """The CPU executor's switch measured dense decode faster in some MoE layers (or all): the
    line says so, not only a decode sparsity under the target."""

    def model(sparse_layers):
        # layer 1 has no routed experts
        net = argparse.Namespace(sparse_layers=sparse_layers, moe_layers=lambda: [0, 2, 3])
        phases = {"prefill": 0.5, "decode": 0.0}
        return argparse.Namespace(sparsity=0.5, achieved_sparsity=0.1, net=net,
                                  sparsity_by_phase=lambda: phases)  # fmt: skip

    head = " | expert sparsity: target 0.50, achieved 0.100 (prefill 0.500, decode 0.000)"
    assert sparsity_report(model([False] * 4)) == (
        head + "; decode dense: measured faster than sparse on this machine"
    )
    assert sparsity_report(model([True, False, False, True])) == (
        head + "; decode sparse in 2 of 3 MoE layers (the rest measured faster dense)"
    )
    assert sparsity_report(model([True, False, True, True])) == head
    assert sparsity_report(model(None)) == head  # no switch (the GPU's, torch's experts)
