"""Dense or sparse decode steps on the CPU, per layer, measured on this machine once, cached.

The sparse expert kernel saves the up and down rows of the neurons a token drops: DRAM bytes and
their arithmetic. It must still read every gate row, and on one or two cores those rows (every
third row of the neuron-contiguous layout) stream at about half the contiguous rate, so the gate
pass alone costs 0.6-0.75 of a dense layer there (bench/cpu_experts.py, bench/cpu_sparse_read.c):
a layer that keeps half its neurons can come out slower than dense, one that keeps a tenth
faster. So, as the GPU's switch does (kernels/switch.py), the choice is measured on the
decoder's own pool (its thread count) with the model's thresholds, after a short random prompt:

1. per layer: the FFN half of decode steps run in pieces (CpuDecoder.begin / attention / ffn /
   end), each MoE layer's ffn() timed dense and sparse, alternated, LAYER_ROUNDS times; a layer
   decodes sparse where its median sparse time is below its median dense time;
2. where some layer won: whole steps dense, with every layer sparse and with that mix (medians
   of ROUNDS alternations of STEPS steps); the fastest of the three is kept (a tie: dense). So
   sparse steps are never slower than dense ones as measured, and per-layer noise (layers of one
   shape measured a few percent apart) costs nothing where every layer sparse wins as a whole.

A dense layer skips nothing, so the output moves towards the dense model's, never away from it;
prefill keeps the thresholds (its batched kernel gains from sparsity at every measured level:
bench/cpu_prefill.py).

Cache: one JSON file per (CPU, threads, SIMD level, key, thresholds, where the sparse gate pass
reads its rows: the file's layout or the gate rows apart (pyruntime.experts.gates), which move the
sparse side's times; SWITCH_VERSION) in the
caller's folder (pyruntime.options.cache_dir() / "cpu_switch"); a second load reads it. The timer
is a parameter (`timer(thresholds or None, fn, layer) -> seconds`, layer None for a whole step),
so the choice and the cache are tested with fake timings.
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
SWITCH_VERSION = 3
PROMPT_TOKENS = 8  # a random prompt before the timed steps (they read its KV cache)
STEPS = 8  # decode steps per whole-step timing, all at the prompt's next position
ROUNDS = 5  # dense / sparse alternations of whole steps; medians of their times
LAYER_ROUNDS = 15  # dense / sparse alternations of steps in pieces; per-layer medians
Thresholds = Sequence[float | None]
# timer(thresholds or None (dense), fn, layer (None: a whole step)) -> seconds of one fn()
Timer = Callable[[Thresholds | None, Callable[[], object], int | None], float]


def perf_timer(thresholds: Thresholds | None, fn: Callable[[], object], layer: int | None) -> float:
    """Seconds of one call of fn."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class DecodeSteps:
    """Decode steps of `net` at one position after a random prompt: each reads the same cache."""

    def __init__(self, net) -> None:
        self.dec = net._decoder
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, net.config.n_vocab, (PROMPT_TOKENS,), generator=gen)
        self.cache = net.new_cache(PROMPT_TOKENS + 1)
        net.forward(prompt, self.cache, last_only=True)
        self.token = int(prompt[-1])
        self.moe = self.moe_layers(net)

    @staticmethod
    def moe_layers(net) -> list[bool]:
        """Per layer, whether it has routed experts."""
        return [blk.experts is not None for blk in net.weights.blocks]

    def whole(self, thr: Thresholds | None) -> None:
        for _ in range(STEPS):
            self.cache.reserve(1)
            self.dec.step(self.token, self.cache, thr)
            self.cache.n_tokens -= 1

    def in_pieces(self, thr: Thresholds | None, timer: Timer) -> list[float]:
        """One step in pieces; seconds of each MoE layer's ffn() (0.0 for the others)."""
        dec, out = self.dec, []
        self.cache.reserve(1)
        dec.begin(self.token, self.cache, thr)
        for i, moe in enumerate(self.moe):
            dec.attention(i)
            if moe:
                out.append(timer(thr, lambda i=i: dec.ffn(i), i))
            else:
                dec.ffn(i)
                out.append(0.0)
        dec.end()
        self.cache.n_tokens -= 1
        return out


def measure(net, candidates: dict[str, Thresholds | None], timer: Timer = perf_timer) -> dict:
    """{name: seconds}: per candidate (thresholds, None: dense), the median over ROUNDS of STEPS
    decode steps (the C step, one token, every layer), the candidates alternated, after a random
    prompt."""
    steps = DecodeSteps(net)
    thr = {name: None if t is None else list(t) for name, t in candidates.items()}
    for t in thr.values():
        steps.whole(t)
    times: dict[str, list[float]] = {name: [] for name in thr}
    for _ in range(ROUNDS):
        for name, t in thr.items():
            times[name].append(timer(t, lambda t=t: steps.whole(t), None))
    return {name: statistics.median(v) for name, v in times.items()}


def measure_layers(net, thresholds: Thresholds, timer: Timer = perf_timer) -> dict:
    """{dense_s, sparse_s}: per layer, the median over LAYER_ROUNDS steps in pieces of its FFN's
    seconds, dense and with `thresholds` alternated (0.0 for layers without routed experts)."""
    steps = DecodeSteps(net)
    thr = list(thresholds)
    steps.in_pieces(None, perf_timer)  # warm-up, untimed
    steps.in_pieces(thr, perf_timer)
    dense, sparse = [], []
    for _ in range(LAYER_ROUNDS):
        dense.append(steps.in_pieces(None, timer))
        sparse.append(steps.in_pieces(thr, timer))
    return dict(dense_s=[statistics.median(t) for t in zip(*dense, strict=True)],
                sparse_s=[statistics.median(t) for t in zip(*sparse, strict=True)])  # fmt: skip


def layers_won(layer_times: dict) -> list[bool]:
    """Per layer: whether its sparse FFN half measured faster than its dense one."""
    return [s < d for d, s in zip(layer_times["dense_s"], layer_times["sparse_s"], strict=True)]


def mixed(thresholds: Thresholds, layers: Sequence[bool]) -> list[float | None]:
    """The thresholds of the sparse layers, None (dense) for the others."""
    return [t if sparse else None for t, sparse in zip(thresholds, layers, strict=True)]


def cache_file(identity: dict, directory: Path) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{identity['key']}__t{identity['threads']}")[:120]
    return directory / f"{stem}__{digest}.json"


def sparse_layers(net, thresholds: Thresholds, key: str, directory: Path, *,
                  timer: Timer = perf_timer,
                  on_measure: Callable[[Path], None] | None = None) -> list[bool]:  # fmt: skip
    """Per layer, whether decode steps run it with its threshold (True) or dense: measured once
    per identity on net's pool (per layer, then the mix against dense steps; see the module
    docstring) and cached in `directory`; on_measure(cache file) just before a measurement."""
    identity = dict(
        key=str(key), threads=net.core.threads, simd=cpu_core.simd_level(),
        cpu=platform.processor() or platform.machine(),
        thresholds=[None if t is None else float(t) for t in thresholds], version=SWITCH_VERSION,
        gates="apart" if getattr(net, "gate_copy_bytes", 0) else "file",
    )  # fmt: skip
    path = cache_file(identity, directory)
    try:
        stored = json.loads(path.read_text())
        if stored.get("identity") == identity:
            return [bool(v) for v in stored["layers"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, unreadable or foreign: measure and (over)write it
    if on_measure is not None:
        on_measure(path)
    per_layer = measure_layers(net, thresholds, timer)
    won = layers_won(per_layer)
    steps = None
    layers = [False] * len(won)
    if any(won):  # the whole step: dense, every layer sparse, the per-layer mix; the fastest
        choices = {"dense": layers, "sparse": DecodeSteps.moe_layers(net)}
        if won != choices["sparse"]:
            choices["mix"] = won
        steps = measure(net, {k: None if not any(v) else mixed(thresholds, v)
                              for k, v in choices.items()}, timer)  # fmt: skip
        layers = choices[min(steps, key=lambda k: (steps[k], k != "dense"))]
    record = dict(identity=identity, layers=layers, layer_timings=per_layer, step_timings=steps,
                  created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)  # atomic: concurrent loaders never read half a file
    except OSError:
        pass  # an unwritable cache: measured again next time
    return layers
