"""kernels.switch: crossover logic and cache of the dense/sparse switch, with a fake timer."""

import json

import pytest
import torch

from pyruntime.kernels import switch
from pyruntime.kernels.dispatch import prepare_experts
from pyruntime.kernels.testing import make_case, n_embd_for


def _experts(fmt="bf16"):
    _, w, _, _ = make_case(fmt, 1)
    return prepare_experts(w, fmt, n_embd_for(fmt))


class FakeTimer:
    """Times from a table {batch: (dense_s, sparse_s)}; runs fn for real at the batches in
    `run_at` (checks the profiled closures work) and records every call."""

    def __init__(self, table, run_at=()):
        self.table, self.run_at, self.calls = table, set(run_at), []

    def __call__(self, path, batch, fn):
        self.calls.append((path, batch))
        if batch in self.run_at:
            out = fn()
            y = out[0] if isinstance(out, tuple) else out
            assert torch.isfinite(y).all()
        return self.table[batch][0 if path == "dense" else 1]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setattr(switch, "DEFAULT_CACHE_DIR", tmp_path / "switch")
    monkeypatch.setattr(switch, "INPUTS_PER_BATCH", 1)  # one timer call per path and batch
    switch._MEMO.clear()


def _call(w, fmt, timer, key="m/layer0/s0.85", **kw):
    n_embd = n_embd_for(fmt.removesuffix("r"))
    return switch.sparse_switch(w, fmt, n_embd, 3, "silu", 0.05, key, timer=timer,
                                batches=(1, 2, 4, 8), **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("table", "won", "timed"),
    [
        ({1: (2, 1), 2: (2, 1), 4: (2, 1), 8: (2, 3)}, (1, 2, 4), [1, 2, 4, 8]),
        ({1: (1, 2), 2: (2, 1), 4: (2, 1), 8: (2, 1)}, (2, 4, 8), [1, 2, 4, 8]),  # dense at 1
        ({1: (2, 1), 2: (2, 2), 4: (2, 1), 8: (2, 1)}, (1, 4, 8), [1, 2, 4, 8]),  # a tie loses
        ({1: (2, 1), 2: (2, 1), 4: (2, 1), 8: (2, 1)}, (1, 2, 4, 8), [1, 2, 4, 8]),
        ({1: (2, 1), 2: (2, 3), 4: (2, 3), 8: (2, 1)}, (1,), [1, 2, 4]),  # two losses: stop
        ({1: (1, 2), 2: (1, 2), 4: (2, 1), 8: (2, 1)}, (), [1, 2]),
    ],
)
def test_sparse_at_the_profiled_batches_where_it_won(table, won, timed):
    w, fmt = _experts()
    timer = FakeTimer(table, run_at=(1,))
    sw = _call(w, fmt, timer)
    assert sw == switch.SparseSwitch(tuple(timed), won)
    assert [b for p, b in timer.calls if p == "dense"] == timed
    assert [b for p, b in timer.calls if p == "sparse"] == timed


def test_a_batch_takes_the_next_profiled_decision():
    sw = switch.SparseSwitch((1, 2, 4, 8), (2, 4))
    assert [sw.use_sparse(t) for t in range(1, 10)] == [False, True, True, True] + [False] * 5
    assert not switch.SparseSwitch().use_sparse(1)
    up = switch.SparseSwitch.up_to(3)
    assert [up.use_sparse(t) for t in (1, 3, 4)] == [True, True, False]
    assert switch.SparseSwitch.up_to(0) == switch.SparseSwitch()


def test_each_batch_is_timed_on_several_inputs_summed(monkeypatch):
    """One token's achieved sparsity scatters: INPUTS_PER_BATCH routings and hidden states per
    batch, their times added before dense and sparse are compared."""
    monkeypatch.setattr(switch, "INPUTS_PER_BATCH", 3)
    w, fmt = _experts()
    seen = []

    def timer(path, batch, fn):
        seen.append((path, batch, fn.args[0].sum().item(), tuple(fn.args[3].flatten().tolist())))
        # sparse loses on one input of three by more than it wins on the others: dense
        return (
            {"dense": 1.0, "sparse": 0.5}[path]
            if len(seen) > 2
            else {"dense": 1.0, "sparse": 3.0}[path]
        )

    sw = _call(w, fmt, timer)
    assert 1 not in sw.won
    first = [s for s in seen if s[0] == "dense" and s[1] == 1]
    assert len(first) == 3 and len({s[2] for s in first}) == 3  # three different x


def test_second_call_reads_the_cache(tmp_path):
    w, fmt = _experts("q8_0")
    table = {1: (2, 1), 2: (2, 1), 4: (2, 3), 8: (2, 3)}
    assert _call(w, fmt, FakeTimer(table, run_at=(1, 2))).won == (1, 2)
    files = list((tmp_path / "switch").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["sparse_batches"] == [1, 2] and stored["identity"]["key"] == "m/layer0/s0.85"
    assert [r["batch"] for r in stored["timings"]] == [1, 2, 4, 8]
    assert stored["profiled"] == [1, 2, 4, 8]

    def no_timing(path, batch, fn):
        raise AssertionError("profiled again despite the cache")

    want = switch.SparseSwitch((1, 2, 4, 8), (1, 2))
    assert _call(w, fmt, no_timing) == want  # this process's memo
    switch._MEMO.clear()
    assert _call(w, fmt, no_timing) == want  # the JSON file
    other = FakeTimer({1: (1, 2), 2: (1, 2)})
    assert _call(w, fmt, other, key="m/layer1/s0.85").won == ()  # another key is profiled
    assert other.calls == [("dense", 1), ("sparse", 1), ("dense", 2), ("sparse", 2)]
    assert len(list((tmp_path / "switch").glob("*.json"))) == 2
    assert _call(w, fmt, FakeTimer(table), refresh=True) == want


def test_on_profile_is_called_before_a_profile_only(tmp_path):
    w, fmt = _experts()
    table = {1: (2, 1), 2: (2, 3), 4: (2, 3)}
    told = []
    _call(w, fmt, FakeTimer(table), on_profile=told.append)
    (path,) = (tmp_path / "switch").glob("*.json")
    assert told == [path]  # called with the cache file it is about to write
    _call(w, fmt, FakeTimer(table), on_profile=told.append)  # memo: no profile, no call
    switch._MEMO.clear()
    _call(w, fmt, FakeTimer(table), on_profile=told.append)  # the file: no call either
    assert told == [path]


def test_corrupt_cache_file_is_profiled_again(tmp_path):
    w, fmt = _experts()
    table = {1: (2, 1), 2: (2, 3), 4: (2, 3), 8: (2, 3)}
    assert _call(w, fmt, FakeTimer(table)).won == (1,)
    (path,) = (tmp_path / "switch").glob("*.json")
    path.write_text("{not json")
    switch._MEMO.clear()
    timer = FakeTimer({1: (2, 1), 2: (2, 1), 4: (2, 3), 8: (2, 3)})
    assert _call(w, fmt, timer).won == (1, 2)
    assert json.loads(path.read_text())["sparse_batches"] == [1, 2]


def test_profile_of_older_kernels_is_not_reused(tmp_path, monkeypatch):
    """A cached profile records KERNELS_VERSION; after a bump the layer is profiled again."""
    w, fmt = _experts()
    assert _call(w, fmt, FakeTimer({1: (2, 1), 2: (2, 3), 4: (2, 3)})).won == (1,)
    (old,) = (tmp_path / "switch").glob("*.json")
    assert json.loads(old.read_text())["identity"]["kernels"] == switch.KERNELS_VERSION
    switch._MEMO.clear()
    monkeypatch.setattr(switch, "KERNELS_VERSION", switch.KERNELS_VERSION + 1)
    timer = FakeTimer({1: (2, 1), 2: (2, 1), 4: (2, 3), 8: (2, 3)})
    assert _call(w, fmt, timer).won == (1, 2)  # profiled anew, not read from the old file
    assert timer.calls[0] == ("dense", 1)
    assert len(list((tmp_path / "switch").glob("*.json"))) == 2


def test_event_seconds_times_each_call_after_its_before(monkeypatch):
    """kernels.timing.event_seconds (the CUDA-event loop of the switch and the benchmarks), with
    stand-in events: before(i) runs ahead of call i and outside its interval, one time a call."""
    import time as _time

    from pyruntime.kernels import timing

    log = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            log.append("record")
            self.t = _time.perf_counter()

        def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: log.append("sync"))

    def call():
        log.append("call")
        _time.sleep(0.002)

    times = timing.event_seconds(
        call, 3, before=lambda i: (log.append(f"before{i}"), _time.sleep(0.05))
    )
    assert log == [x for i in range(3) for x in (f"before{i}", "record", "call", "record", "sync")]
    assert len(times) == 3 and all(0.002 <= t < 0.05 for t in times)  # seconds, before excluded
