"""Dense or sparse CPU decode steps (pyruntime.cpu.sparse_switch): where sparse steps lost, the
model decodes dense (the same logits and counts as no threshold), prefill keeps the thresholds,
the choice is measured once per identity and read back from the cache."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf

THRESHOLD = 0.02


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("switch")
    return convert(make_tiny_hf_model("mixtral", tmp / "hf"), tmp / "m.gguf", "q8_0", False)


def load(path, threads: int = 1, thresholds: bool = True) -> CpuExecutor:
    net = CpuExecutor.from_gguf(open_gguf(path), threads=threads, expert_backend="c")
    if thresholds:
        net.expert_threshold = [THRESHOLD] * net.config.n_layer
    return net


def fake_timer(sparse_wins: bool, calls: list):
    """A timer under which sparse steps win or lose (each call still runs its steps)."""

    def timer(thresholds, fn):
        calls.append(thresholds)
        fn()
        return 1.0 if (thresholds is not None) == sparse_wins else 2.0

    return timer


def decode(net: CpuExecutor, ids: torch.Tensor, dense_steps: bool = False):
    """Logits, active and all neurons of forward() per token after a 4-token prefill; with
    dense_steps, the C step called directly with no thresholds instead (the reference)."""
    cache = net.new_cache(len(ids))
    net.forward(ids[:4], cache)  # prefill, with the thresholds
    net.stats.reset()
    rows, active, neurons = [], 0, 0
    for j in range(4, len(ids)):
        if not dense_steps:
            rows.append(net.forward(ids[j : j + 1], cache))
            continue
        cache.reserve(1)
        logits, n_active = net._decoder.step(int(ids[j]), cache, None)
        rows.append(logits)
        active += n_active
        neurons += net._decoder.n_pairs * net.config.n_ff_exp
    if dense_steps:
        return torch.cat(rows), active, neurons
    return torch.cat(rows), net.stats.active, net.stats.neurons


def test_where_sparse_steps_lose_the_model_decodes_dense(gguf, tmp_path):
    ids = torch.randint(0, 4096, (10,), generator=torch.Generator().manual_seed(1))
    net = load(gguf)
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(False, calls))
    assert net.sparse_decode is False
    assert None in calls and [THRESHOLD] * net.config.n_layer in calls  # both timed
    assert net.stats.pairs == 0  # the measurement's own steps are not counted
    got, active, neurons = decode(net, ids)
    want, want_active, _ = decode(load(gguf), ids, dense_steps=True)
    assert torch.equal(got, want) and active == want_active == neurons  # dense steps
    sparse = load(gguf)
    s_logits, s_active, s_neurons = decode(sparse, ids)
    assert s_active < s_neurons and not torch.equal(got, s_logits)
    # prefill keeps the thresholds: the all-sparse model's logits
    assert torch.equal(
        net.forward(ids, net.new_cache(10)), sparse.forward(ids, sparse.new_cache(10))
    )


def test_where_sparse_steps_win_they_stay(gguf, tmp_path):
    net = load(gguf)
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(True, []))
    assert net.sparse_decode is True


def test_the_choice_is_cached_per_identity(gguf, tmp_path):
    net = load(gguf)
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(False, calls))
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["sparse"] is False and set(record["timings"]) == {"dense_s", "sparse_s"}
    calls.clear()
    again = load(gguf)
    again.choose_decode_sparsity("m", tmp_path, timer=fake_timer(True, calls))
    assert again.sparse_decode is False and calls == []  # read back, not measured
    other = load(gguf, threads=2)  # another thread count: measured on its own
    other.choose_decode_sparsity("m", tmp_path, timer=fake_timer(True, calls))
    assert other.sparse_decode is True and calls
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_the_real_timer_measures_both(gguf, tmp_path):
    net = load(gguf)
    net.choose_decode_sparsity("m", tmp_path)
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["timings"]["dense_s"] > 0 and record["timings"]["sparse_s"] > 0
    assert net.sparse_decode is (record["timings"]["sparse_s"] < record["timings"]["dense_s"])


def test_without_thresholds_nothing_is_measured(gguf, tmp_path):
    net = load(gguf, thresholds=False)
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(False, calls))
    assert net.sparse_decode is True and calls == [] and not list(tmp_path.iterdir())
