"""Where a missed expert is computed: the cost model's split (pyruntime.offload.costs) with
given costs, and the cache of measured costs."""

from __future__ import annotations

import json

import pytest

from pyruntime.errors import PyruntimeWarning
from pyruntime.offload.costs import Costs, Split, load_or_measure, read_share, split_misses

B = 1 << 20  # bytes of an expert


def costs(cpu_expert=100e-6, stage_expert=150e-6, cpu_pair=10e-6, call=0.0, host_round=0.0,
          host_expert=0.0, handoff=0.0, launch=0.0) -> Costs:  # fmt: skip
    return Costs(B, B / stage_expert / 1e9, call, cpu_expert, cpu_pair, 0.0, 0.0, host_round,
                 host_expert, handoff, launch)  # fmt: skip


def test_decode_misses_split_in_proportion_to_the_two_rates():
    """One token each: the CPU (110 us an expert) takes 6 of 10, staging (150 us) 4."""
    cpu, stage, on_worker = split_misses([(e, 1) for e in range(10)], costs())
    assert len(cpu) == 6 and len(stage) == 4
    t_cpu = costs().cpu_seconds([1] * len(cpu))
    t_stage = costs().stage_seconds([1] * len(stage))
    assert abs(t_cpu - t_stage) <= 110e-6  # they finish within one expert of each other
    assert not on_worker  # worker="never" (the default): inline
    assert split_misses([(0, 1)], costs()) == ([0], [], False)  # the CPU alone is sooner
    assert split_misses([(0, 1)], costs(cpu_expert=140e-6))[:2] == ([0], [])  # a tie: the CPU


def test_prefill_stages_the_experts_with_many_tokens():
    misses = [(0, 64), (1, 2), (2, 40), (3, 1), (4, 30)]
    cpu, stage, _ = split_misses(misses, costs())
    assert stage == [0, 2, 4] and cpu == [1, 3]  # 450 us each side at most
    assert split_misses(misses, costs(), capacity=1)[:2] == ([2, 4, 1, 3], [0])


def test_sparsity_makes_the_cpu_cheaper():
    misses = [(e, 1) for e in range(10)]
    dense_cpu = split_misses(misses, costs()).cpu
    sparse_cpu = split_misses(misses, costs(), read=read_share(0.9)).cpu
    assert len(sparse_cpu) > len(dense_cpu)
    assert read_share(0.0) == 1.0 and read_share(1.0) == pytest.approx(1 / 3)


def test_a_call_cost_keeps_a_single_cheap_miss_off_the_cpu():
    assert split_misses([(0, 1)], costs(call=1e-3))[:2] == ([], [0])
    assert split_misses([(0, 1)], costs(), capacity=0)[:2] == ([0], [])
    assert costs().stage_seconds([1]) == pytest.approx(150e-6)
    assert Costs(B, 0.0, 0, 0, 0, 0, 0).stage_seconds([1]) == float("inf")


def test_the_hosts_queueing_of_a_staged_round_comes_before_an_inline_cpu_share():
    """10 decode misses: the CPU alone 1.1 ms; split 6 / 4 the sides take 0.66 / 0.60 ms. When
    queueing the staged round costs the host 0.5 ms and the C core runs on the same thread
    after it (inline), the split would end at 1.16 ms: all stay on the CPU. With the CPU's share
    on a worker thread the queueing delays only the copies: 2 staged (0.5 + 0.30 ms vs 0.88)."""
    misses = [(e, 1) for e in range(10)]
    slow_host = costs(host_round=500e-6)
    cpu, stage, _ = split_misses(misses, slow_host)
    assert len(cpu) == 10 and stage == []
    cpu, stage, on_worker = split_misses(misses, slow_host, worker="always")
    assert len(cpu) == 8 and len(stage) == 2 and on_worker
    per_expert = costs(host_expert=130e-6)  # each staged expert costs more than it saves
    assert split_misses(misses, per_expert).stage == []
    assert split_misses(misses, costs(host_expert=60e-6)).stage == [0, 1, 2, 3]  # 0.24 + 0.66 ms
    assert per_expert.host_seconds(2) == pytest.approx(260e-6)
    assert costs(host_round=1.0).host_seconds(0) == 0.0  # nothing staged, nothing queued


def test_the_kernels_eager_launch_is_charged_only_where_staging_causes_it():
    """A layer with hits launches its expert kernel anyway, and a decode step's is a graph
    replay: the eager launch (0.5 ms here) is charged only where the caller says staging makes
    it (launch=True: no hits, no graph)."""
    misses = [(e, 1) for e in range(10)]
    slow_launch = costs(launch=500e-6)
    assert split_misses(misses, slow_launch) == split_misses(misses, costs())
    assert split_misses(misses, slow_launch, launch=True).stage == []
    assert slow_launch.host_seconds(2, launch=True) == pytest.approx(500e-6)
    assert slow_launch.host_seconds(0, launch=True) == 0.0


def test_auto_hands_the_cpu_share_to_the_worker_where_the_staging_costs_the_host_more():
    """worker="auto": per prefix, inline or on the worker, whichever finishes sooner. A slow
    host (0.5 ms a round) and a 50 us handoff: 2 staged, the CPU's 8 (0.88 ms + 0.05) on the
    worker; nothing staged: inline (a handoff buys nothing); a handoff dearer than the host's
    queueing: inline."""
    misses = [(e, 1) for e in range(10)]
    slow_host = costs(host_round=500e-6, handoff=50e-6)
    cpu, stage, on_worker = split_misses(misses, slow_host, worker="auto")
    assert len(cpu) == 8 and len(stage) == 2 and on_worker
    assert split_misses(misses, slow_host, worker="never") == Split(list(range(10)), [], False)
    assert split_misses(misses, costs(handoff=50e-6), worker="auto") == split_misses(
        misses, costs()
    )  # a free host: the inline split, no handoff
    assert not split_misses([(0, 1)], slow_host, worker="auto").on_worker  # nothing staged
    slow_handoff = costs(host_round=100e-6, handoff=400e-6)
    assert not split_misses(misses, slow_handoff, worker="auto").on_worker
    # always: the handoff is paid wherever the CPU has a share
    assert split_misses([(0, 1)], slow_host, worker="always") == Split([0], [], True)
    with pytest.raises(ValueError, match="worker must be"):
        split_misses(misses, costs(), worker="sometimes")


def test_costs_are_measured_once_per_key(tmp_path):
    calls = []

    def measure() -> Costs:
        calls.append(1)
        return costs()

    assert load_or_measure("a", tmp_path, measure) == costs()
    assert load_or_measure("a", tmp_path, measure) == costs() and len(calls) == 1
    load_or_measure("b", tmp_path, measure)
    assert len(calls) == 2  # another machine or shape
    [path] = [p for p in tmp_path.iterdir() if json.loads(p.read_text())["key"] == "a"]
    path.write_text("{not json")
    load_or_measure("a", tmp_path, measure)
    assert len(calls) == 3  # a damaged file is measured again


def test_an_unwritable_cache_warns_and_uses_the_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(PyruntimeWarning, match="cannot cache the measured offload costs"):
        assert load_or_measure("a", blocker / "sub", costs) == costs()
