"""Dense or sparse decode steps on the CPU, measured on this machine once, cached.

The sparse expert kernel saves the up and down rows of the neurons a token drops: DRAM bytes.
Where a decode step is arithmetic-bound instead (one or two cores on a fast memory), its extra
work (the gates in a pass of their own, the per-neuron bookkeeping) can cost more than the bytes
save: granite-1b-a400m Q8_0 on one core of the 2-core box decoded at 0.91x the dense speed with
50% of the neurons skipped, 1.19x with 87%. So, as the GPU's switch does (kernels/switch.py),
the model's decode step is timed dense and sparse on the decoder's own pool (its thread count)
with its thresholds, after a short random prompt, and decodes sparse only where sparse won. The
choice is per model, not per layer: one layer's experts timed alone came out within +-10% of
dense either way at 50% skipped, noise on a shared machine, while the whole steps differed
consistently. A model that decodes dense skips nothing, so its output moves towards the dense
model's, never away from it; prefill keeps the thresholds (its batched kernel gains from
sparsity at every measured level: bench/cpu_prefill.py).

Cache: one JSON file per (CPU, threads, SIMD level, key, thresholds, SWITCH_VERSION) in the
caller's folder (pyruntime.options.cache_dir() / "cpu_switch"); a second load reads it. The timer
is a parameter (`timer(thresholds or None, fn) -> seconds`), so the choice and the cache are
tested with a fake one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pyruntime.cpu import core as cpu_core

# Part of every cached choice's identity: bump it when the expert kernels change.
SWITCH_VERSION = 2
PROMPT_TOKENS = 8  # a random prompt before the timed steps (they read its KV cache)
STEPS = 8  # decode steps per timing, all at the prompt's next position
ROUNDS = 5  # dense / sparse alternations; medians of their times
Timer = Callable[[Sequence[float] | None, Callable[[], object]], float]


def perf_timer(thresholds: Sequence[float] | None, fn: Callable[[], object]) -> float:
    """Seconds of one call of fn."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(net, thresholds: Sequence[float], timer: Timer = perf_timer) -> dict:
    """{dense_s, sparse_s}: medians over ROUNDS of STEPS decode steps (the C step, one token,
    every layer) with no threshold and with `thresholds`, alternated, after a random prompt."""
    dec = net._decoder
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, net.config.n_vocab, (PROMPT_TOKENS,), generator=gen)
    cache = net.new_cache(PROMPT_TOKENS + 1)
    net.forward(prompt, cache, last_only=True)
    token = int(prompt[-1])

    def steps(thr: Sequence[float] | None) -> None:
        for _ in range(STEPS):
            cache.reserve(1)
            dec.step(token, cache, thr)
            cache.n_tokens -= 1  # the same position again: each step reads the same cache

    list_thr = [float(t) for t in thresholds]
    steps(None)
    steps(list_thr)
    dense, sparse = [], []
    for _ in range(ROUNDS):
        dense.append(timer(None, lambda: steps(None)))
        sparse.append(timer(list_thr, lambda: steps(list_thr)))
    return dict(dense_s=statistics.median(dense), sparse_s=statistics.median(sparse))


def cache_file(identity: dict, directory: Path) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{identity['key']}__t{identity['threads']}")[:120]
    return directory / f"{stem}__{digest}.json"


def sparse_wins(net, thresholds: Sequence[float], key: str, directory: Path, *,
                timer: Timer = perf_timer,
                on_measure: Callable[[Path], None] | None = None) -> bool:  # fmt: skip
    """Whether decode steps with `thresholds` beat dense ones on net's pool, measured once per
    identity and cached in `directory`; on_measure(cache file) just before a measurement."""
    identity = dict(
        key=str(key), threads=net.core.threads, simd=cpu_core.simd_level(),
        cpu=platform.processor() or platform.machine(),
        thresholds=[float(t) for t in thresholds], version=SWITCH_VERSION,
    )  # fmt: skip
    path = cache_file(identity, directory)
    try:
        stored = json.loads(path.read_text())
        if stored.get("identity") == identity:
            return bool(stored["sparse"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, unreadable or foreign: measure and (over)write it
    if on_measure is not None:
        on_measure(path)
    times = measure(net, thresholds, timer)
    wins = times["sparse_s"] < times["dense_s"]
    record = dict(identity=identity, sparse=wins, timings=times,
                  created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)  # atomic: concurrent loaders never read half a file
    except OSError:
        pass  # an unwritable cache: measured again next time
    return wins
