"""Dense/sparse switch: the batch sizes at which the sparse MoE path beats the dense one.

Activation sparsity saves the up/down rows of inactive neurons, but once many tokens share an
expert the union of their active neurons covers most rows and the sparse path only adds work
(gate pass + masks); at one token a fast dense kernel can also win (the sparse path's two
dependent round trips to HBM over few bytes). Where sparse wins depends on the GPU, the expert
shape and format and the sparsity, so it is profiled once per GPU and model layer with the
layer's own expert weights and threshold, and cached:

    sw = sparse_switch(w, fmt, n_embd, top_k, activation, threshold, key)
    y, active = moe_experts(x, w, fmt, ids, tw, activation, threshold, switch=sw)

The profile times `moe_dense` and `moe_sparse` at T = 1, 2, 4, ..., 256 tokens (random
routings and hidden states, or sampled ones; below INPUTS_PER_BATCH tokens on several inputs,
times summed, as one token's achieved sparsity scatters) until sparse has lost at two batches
in a row; a step of T tokens takes the decision of the smallest profiled batch >= T (dense past
the last), so the switch is never on where sparse lost.
Cache: one JSON file per (GPU name, key, format, shape, threshold, KERNELS_VERSION) in the
caller's directory (default ~/.cache/pyruntime/switch/); a second call reads it. The decision
itself, dense or sparse at T tokens and then which kernel, is kernels.expert_paths'.

The timer is a parameter (`timer(path, batch, fn) -> seconds`), so the crossover logic and the
cache are tested on CPU with a fake timer; the default one replays a CUDA graph of fn with the
L2 flushed before each replay (weights come from HBM, as in a decode step).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from .expert_paths import SparseSwitch
from .moe_dense import moe_dense
from .moe_sparse import moe_sparse
from .timing import capture, event_seconds, l2_evictor, warm_up

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Part of every profile's identity: bump it whenever the MoE kernels, their configs or their
# path choices (kernels.expert_paths) change, so a profile measured with older kernels is never
# reused.
KERNELS_VERSION = 6
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "pyruntime" / "switch"
# Tokens timed per profiled batch at least: a batch of T tokens runs on INPUTS_PER_BATCH // T
# inputs (routing, hidden states), their times summed.
INPUTS_PER_BATCH = 4
Timer = Callable[[str, int, Callable[[], object]], float]  # (path, batch, fn) -> seconds

_MEMO: dict[Path, SparseSwitch] = {}  # this process's profiles, by cache file


def device_name(device: torch.device) -> str:
    """The GPU's name (the profile holds for that model of GPU), or 'cpu'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _threshold_value(threshold) -> float:
    if isinstance(threshold, torch.Tensor):
        return float(threshold.reshape(-1)[0].item())  # load time: one host sync is fine
    return float(threshold)


def cache_file(identity: dict, directory: Path | None = None) -> Path:
    """The JSON file of one profile: readable GPU + key prefix, hash of the whole identity."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{identity['gpu']}__{identity['key']}")[:120]
    return (directory or DEFAULT_CACHE_DIR) / f"{stem}__{digest}.json"


def _random_inputs(w, n_embd, top_k, T, x_sample, seed):
    """(x [T, n_embd], topk_ids [T, top_k] int32, topk_w [T, top_k] f32) on w's device:
    uniformly random distinct experts per token; x cycles x_sample's rows, else N(0, 1) bf16."""
    gen = torch.Generator().manual_seed(seed)
    n_expert = w.shape[0]
    ids = torch.rand(T, n_expert, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    tw = torch.rand(T, top_k, generator=gen)
    tw = tw / tw.sum(dim=1, keepdim=True)
    if x_sample is not None:
        x = x_sample[torch.arange(T) % x_sample.shape[0]].contiguous()
    else:
        dtype = torch.bfloat16 if w.device.type == "cuda" else torch.float32
        x = torch.randn(T, n_embd, generator=gen).to(dtype)
    return x.to(w.device), ids.to(w.device), tw.to(w.device)


def graph_timer(reps: int = 20) -> Timer:
    """Median seconds of fn replayed in a CUDA graph, L2 flushed before each replay (eager
    perf_counter timing off CUDA)."""

    def timer(path: str, batch: int, fn: Callable[[], object]) -> float:
        if not torch.cuda.is_available():
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        warm_up(fn)  # compile and warm up outside the capture
        graph = capture(fn)
        evict = l2_evictor("cuda")  # weights from HBM on every replay (see l2_evictor)
        times = event_seconds(graph.replay, reps + 2, before=lambda i: evict())
        return statistics.median(times[2:])

    return timer


def profile(w, fmt, n_embd, top_k, activation, threshold, timer: Timer, batches=BATCHES,
            x_sample=None) -> tuple[SparseSwitch, list[dict]]:  # fmt: skip
    """(the switch, the timings measured): dense and sparse at each batch, summed over
    max(1, INPUTS_PER_BATCH // T) inputs; stops after sparse lost at two batches in a row
    (larger batches share even more rows)."""
    thr = torch.full((1,), _threshold_value(threshold), dtype=torch.float32, device=w.device)
    won, rows = [], []
    for T in sorted(batches):
        t_dense = t_sparse = 0.0
        for r in range(max(1, INPUTS_PER_BATCH // T)):
            x, ids, tw = _random_inputs(w, n_embd, top_k, T, x_sample, seed=1000 * r + T)
            t_dense += timer("dense", T, partial(moe_dense, x, w, fmt, ids, tw, activation))
            t_sparse += timer("sparse", T, partial(moe_sparse, x, w, fmt, ids, tw, thr,
                                                   activation))  # fmt: skip
        rows.append(dict(batch=T, dense_s=t_dense, sparse_s=t_sparse))
        if t_sparse < t_dense:
            won.append(T)
        elif len(rows) >= 2 and rows[-2]["batch"] not in won:  # lost here and the batch before
            break
    return SparseSwitch(tuple(r["batch"] for r in rows), tuple(won)), rows


def sparse_switch(w: torch.Tensor, fmt: str, n_embd: int, top_k: int, activation: str,
                  threshold, key: str, *, timer: Timer | None = None, batches=BATCHES,
                  x_sample: torch.Tensor | None = None, directory: Path | None = None,
                  refresh: bool = False,
                  on_profile: Callable[[Path], None] | None = None) -> SparseSwitch:  # fmt: skip
    """The batch sizes at which moe_experts should take the sparse path (SparseSwitch).

    w, fmt: the prepared expert tensor (kernels.dispatch.prepare_experts) on its GPU;
    threshold: the calibrated |act(gate)| threshold (float or [1] tensor) of this layer;
    key: the model identity, layer and sparsity (the caller's; the GPU name, format, shape and
    threshold are added); directory: where profiles are cached (default DEFAULT_CACHE_DIR).
    x_sample [N, n_embd]: real hidden states to profile with (optional; the sparsity reached by
    random ones may differ). Profiled once, then read from the cache;
    on_profile(cache file) is called just before a profile runs (not on a cache hit), so a
    caller can say why the first load takes longer.
    """
    identity = dict(
        gpu=device_name(w.device), key=str(key), fmt=fmt, shape=list(w.shape), top_k=top_k,
        activation=activation, threshold=_threshold_value(threshold), batches=sorted(batches),
        kernels=KERNELS_VERSION,
    )  # fmt: skip
    path = cache_file(identity, directory)
    if not refresh:
        if path in _MEMO:
            return _MEMO[path]
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
                if stored.get("identity") == identity:
                    _MEMO[path] = SparseSwitch(
                        tuple(int(b) for b in stored["profiled"]),
                        tuple(int(b) for b in stored["sparse_batches"]),
                    )
                    return _MEMO[path]
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable or foreign file: profile again and overwrite it
    if on_profile is not None:
        on_profile(path)
    best, rows = profile(w, fmt, n_embd, top_k, activation, threshold,
                         timer or graph_timer(), batches, x_sample)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    record = dict(identity=identity, profiled=list(best.profiled),
                  sparse_batches=list(best.won), timings=rows,
                  created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # atomic: concurrent loaders never read half a file
    _MEMO[path] = best
    return best
