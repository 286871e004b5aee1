"""kernels.switch: crossover logic and cache of the dense/sparse switch, with a fake timer."""

import json

import pytest
import torch

from kernels import switch
from kernels.dispatch import prepare_experts
from kernels.testing import make_case, n_embd_for


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
    monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path))
    switch._MEMO.clear()


def _call(w, fmt, timer, key="m/layer0/s0.85", **kw):
    n_embd = n_embd_for(fmt.removesuffix("r"))
    return switch.sparse_max_batch(w, fmt, n_embd, 3, "silu", 0.05, key, timer=timer,
                                   batches=(1, 2, 4, 8), **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("table", "want", "timed"),
    [
        ({1: (2, 1), 2: (2, 1), 4: (2, 1), 8: (2, 3)}, 4, [1, 2, 4, 8]),
        ({1: (1, 2), 2: (2, 1), 4: (2, 1), 8: (2, 1)}, 0, [1]),  # loses at 1: never sparse
        ({1: (2, 1), 2: (2, 2), 4: (2, 1), 8: (2, 1)}, 1, [1, 2]),  # a tie is not a win
        ({1: (2, 1), 2: (2, 1), 4: (2, 1), 8: (2, 1)}, 8, [1, 2, 4, 8]),
    ],
)
def test_crossover_is_last_batch_of_the_winning_prefix(table, want, timed):
    w, fmt = _experts()
    timer = FakeTimer(table, run_at=(1,))
    assert _call(w, fmt, timer) == want
    assert [b for p, b in timer.calls if p == "dense"] == timed
    assert [b for p, b in timer.calls if p == "sparse"] == timed


def test_second_call_reads_the_cache(tmp_path):
    w, fmt = _experts("q8_0")
    table = {1: (2, 1), 2: (2, 1), 4: (2, 3), 8: (2, 3)}
    assert _call(w, fmt, FakeTimer(table, run_at=(1, 2))) == 2
    files = list((tmp_path / "switch").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["sparse_max_batch"] == 2 and stored["identity"]["key"] == "m/layer0/s0.85"
    assert [r["batch"] for r in stored["timings"]] == [1, 2, 4]

    def no_timing(path, batch, fn):
        raise AssertionError("profiled again despite the cache")

    assert _call(w, fmt, no_timing) == 2  # this process's memo
    switch._MEMO.clear()
    assert _call(w, fmt, no_timing) == 2  # the JSON file
    other = FakeTimer({1: (1, 2)})
    assert _call(w, fmt, other, key="m/layer1/s0.85") == 0  # another key is profiled
    assert other.calls == [("dense", 1), ("sparse", 1)]
    assert len(list((tmp_path / "switch").glob("*.json"))) == 2
    assert _call(w, fmt, FakeTimer(table), refresh=True) == 2


def test_corrupt_cache_file_is_profiled_again(tmp_path):
    w, fmt = _experts()
    table = {1: (2, 1), 2: (2, 3), 4: (2, 3), 8: (2, 3)}
    assert _call(w, fmt, FakeTimer(table)) == 1
    (path,) = (tmp_path / "switch").glob("*.json")
    path.write_text("{not json")
    switch._MEMO.clear()
    timer = FakeTimer({1: (2, 1), 2: (2, 1), 4: (2, 3), 8: (2, 3)})
    assert _call(w, fmt, timer) == 2
    assert json.loads(path.read_text())["sparse_max_batch"] == 2


def test_profile_of_older_kernels_is_not_reused(tmp_path, monkeypatch):
    """A cached profile records KERNELS_VERSION; after a bump the layer is profiled again."""
    w, fmt = _experts()
    assert _call(w, fmt, FakeTimer({1: (2, 1), 2: (2, 3)})) == 1
    (old,) = (tmp_path / "switch").glob("*.json")
    assert json.loads(old.read_text())["identity"]["kernels"] == switch.KERNELS_VERSION
    switch._MEMO.clear()
    monkeypatch.setattr(switch, "KERNELS_VERSION", switch.KERNELS_VERSION + 1)
    timer = FakeTimer({1: (2, 1), 2: (2, 1), 4: (2, 3)})
    assert _call(w, fmt, timer) == 2  # profiled anew, not read from the old file
    assert timer.calls[0] == ("dense", 1)
    assert len(list((tmp_path / "switch").glob("*.json"))) == 2


def test_event_seconds_times_each_call_after_its_before(monkeypatch):
    """kernels.timing.event_seconds (the CUDA-event loop of the switch and the benchmarks), with
    stand-in events: before(i) runs ahead of call i and outside its interval, one time a call."""
    import time as _time

    from kernels import timing

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
