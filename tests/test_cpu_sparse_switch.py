"""Dense or sparse CPU decode steps per layer (pyruntime.cpu.sparse_switch), under injected
timings: a layer whose sparse FFN lost decodes dense (the same logits and counts as its threshold
absent), a mix that loses to dense steps as a whole decodes dense everywhere, prefill keeps the
thresholds, the choice is measured once per identity and read back from the cache."""

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


def kind(thresholds) -> str:
    """dense (None), sparse (every layer's threshold) or mix (some layers None)."""
    if thresholds is None:
        return "dense"
    return "mix" if None in thresholds else "sparse"


def fake_timer(layer_wins, step_times: dict, calls: list):
    """A timer under which layer i's sparse FFN wins where layer_wins[i], and a whole step takes
    step_times[kind(thresholds)] seconds (each call still runs its fn); calls gets (thresholds,
    layer) per call."""

    def timer(thresholds, fn, layer):
        calls.append((thresholds, layer))
        fn()
        if layer is None:
            return step_times[kind(thresholds)]
        return 1.0 if (thresholds is not None) == layer_wins[layer] else 2.0

    return timer


SPARSE_WINS = {"dense": 2.0, "sparse": 1.0, "mix": 1.5}
MIX_WINS = {"dense": 2.0, "sparse": 1.5, "mix": 1.0}
DENSE_WINS = {"dense": 1.0, "sparse": 1.5, "mix": 1.5}


def decode(net: CpuExecutor, ids: torch.Tensor, steps: bool = False, thresholds=None):
    """Logits, active and all neurons of forward() per token after a 4-token prefill; with
    steps, the C step called directly with `thresholds` instead (the reference)."""
    cache = net.new_cache(len(ids))
    net.forward(ids[:4], cache)  # prefill, with the thresholds
    net.stats.reset()
    rows, active, neurons = [], 0, 0
    for j in range(4, len(ids)):
        if not steps:
            rows.append(net.forward(ids[j : j + 1], cache))
            continue
        cache.reserve(1)
        logits, n_active = net._decoder.step(int(ids[j]), cache, thresholds)
        rows.append(logits)
        active += n_active
        neurons += net._decoder.n_pairs * net.config.n_ff_exp
    if steps:
        return torch.cat(rows), active, neurons
    return torch.cat(rows), net.stats.active, net.stats.neurons


IDS = torch.randint(0, 4096, (10,), generator=torch.Generator().manual_seed(1))


def test_where_sparse_layers_lose_the_model_decodes_dense(gguf, tmp_path):
    net = load(gguf)
    n_layer = net.config.n_layer
    calls: list = []
    net.choose_decode_sparsity(
        "m", tmp_path, timer=fake_timer([False] * n_layer, SPARSE_WINS, calls)
    )
    assert net.sparse_decode is False and net.sparse_layers == [False] * n_layer
    thr = [THRESHOLD] * n_layer
    for i in range(n_layer):  # every layer timed both ways; no layer won: no whole steps
        assert (None, i) in calls and (thr, i) in calls
    assert all(layer is not None for _, layer in calls)
    assert net.stats.pairs == 0  # the measurement's own steps are not counted
    got, active, neurons = decode(net, IDS)
    want, want_active, _ = decode(load(gguf), IDS, steps=True)
    assert torch.equal(got, want) and active == want_active == neurons  # dense steps
    sparse = load(gguf)
    s_logits, s_active, s_neurons = decode(sparse, IDS)
    assert s_active < s_neurons and not torch.equal(got, s_logits)
    # prefill keeps the thresholds: the all-sparse model's logits
    assert torch.equal(
        net.forward(IDS, net.new_cache(10)), sparse.forward(IDS, sparse.new_cache(10))
    )


def test_where_dense_steps_win_as_a_whole_the_model_decodes_dense(gguf, tmp_path):
    net = load(gguf)
    n_layer = net.config.n_layer
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer([True] * n_layer, DENSE_WINS, calls))
    assert net.sparse_decode is False and net.sparse_layers == [False] * n_layer
    assert (None, None) in calls and ([THRESHOLD] * n_layer, None) in calls  # steps timed
    got, _, _ = decode(net, IDS)
    assert torch.equal(got, decode(load(gguf), IDS, steps=True)[0])


def test_where_sparse_steps_win_they_stay(gguf, tmp_path):
    net = load(gguf)
    n_layer = net.config.n_layer
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer([True] * n_layer, SPARSE_WINS, []))
    assert net.sparse_decode is True and net.sparse_layers == [True] * n_layer
    got, _, _ = decode(net, IDS)
    assert torch.equal(got, decode(load(gguf), IDS, steps=True, thresholds=net.expert_threshold)[0])


def test_each_layer_decodes_as_it_measured(gguf, tmp_path):
    net = load(gguf)
    n_layer = net.config.n_layer
    assert n_layer >= 2
    wins = [i % 2 == 0 for i in range(n_layer)]  # layer 0 sparse, layer 1 dense, ...
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(wins, MIX_WINS, calls))
    assert net.sparse_decode is True and net.sparse_layers == wins
    mix = [THRESHOLD if w else None for w in wins]
    assert (mix, None) in calls  # the mix, not all-sparse, was timed against dense steps
    got, active, neurons = decode(net, IDS)
    want, want_active, _ = decode(load(gguf), IDS, steps=True, thresholds=mix)
    assert torch.equal(got, want) and active == want_active < neurons
    dense, _, _ = decode(load(gguf), IDS, steps=True)
    sparse, _, _ = decode(load(gguf), IDS, steps=True, thresholds=[THRESHOLD] * n_layer)
    assert not torch.equal(got, dense) and not torch.equal(got, sparse)


def test_where_every_layer_sparse_beats_the_mix_it_is_kept(gguf, tmp_path):
    net = load(gguf)
    n_layer = net.config.n_layer
    wins = [i % 2 == 0 for i in range(n_layer)]
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(wins, SPARSE_WINS, []))
    assert net.sparse_decode is True and net.sparse_layers == [True] * n_layer


def test_the_choice_is_cached_per_identity(gguf, tmp_path):
    net = load(gguf)
    n_layer = net.config.n_layer
    wins = [i % 2 == 0 for i in range(n_layer)]
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(wins, MIX_WINS, calls))
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["layers"] == wins
    assert set(record["layer_timings"]) == {"dense_s", "sparse_s"}
    assert set(record["step_timings"]) == {"dense", "sparse", "mix"}
    calls.clear()
    again = load(gguf)
    again.choose_decode_sparsity(
        "m", tmp_path, timer=fake_timer([True] * n_layer, SPARSE_WINS, calls)
    )
    assert again.sparse_layers == wins and calls == []  # read back, not measured
    other = load(gguf, threads=2)  # another thread count: measured on its own
    other.choose_decode_sparsity(
        "m", tmp_path, timer=fake_timer([True] * n_layer, SPARSE_WINS, calls)
    )
    assert other.sparse_layers == [True] * n_layer and calls
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_the_real_timer_measures_both(gguf, tmp_path):
    net = load(gguf)
    net.choose_decode_sparsity("m", tmp_path)
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    layer_t = record["layer_timings"]
    assert all(t > 0 for t in layer_t["dense_s"] + layer_t["sparse_s"])
    won = [s < d for d, s in zip(layer_t["dense_s"], layer_t["sparse_s"], strict=True)]
    steps = record["step_timings"]
    if steps is None:
        assert not any(won) and record["layers"] == won
    else:
        assert all(t > 0 for t in steps.values())
        fastest = min(steps, key=lambda k: (steps[k], k != "dense"))
        layers = {"dense": [False] * len(won), "sparse": [True] * len(won), "mix": won}[fastest]
        assert record["layers"] == layers
    assert net.sparse_layers == record["layers"] and net.sparse_decode is any(record["layers"])


def test_without_thresholds_nothing_is_measured(gguf, tmp_path):
    net = load(gguf, thresholds=False)
    calls: list = []
    net.choose_decode_sparsity("m", tmp_path, timer=fake_timer([False] * 8, DENSE_WINS, calls))
    assert net.sparse_decode is True and calls == [] and not list(tmp_path.iterdir())
