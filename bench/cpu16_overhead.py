"""What the Python wrapper adds to a pyrt_moe_ffn call: CpuCore.moe_ffn as it is, the wrapper
before commit cpu16 (type-name casts, _lib() per call, no fast path in _as_cpu), and the bare cffi
call with every pointer made beforehand (the floor). One process, variants interleaved per round,
each round `--calls` back-to-back calls per variant on layer copies cycled from DRAM, fresh random
routing per call (as bench/cpu_experts.py); prints median us per call.

    PYTHONPATH=. python bench/cpu16_overhead.py --shape olmoe-1b-7b --rounds 5

With PYRT_PROFILE set to --calls, the kernel's profile of each variant's round (C-side entry and
call time) follows that variant's label on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from bench.cpu_experts import FMTS, SHAPES, layer_copies
from pyruntime import cpu_core
from pyruntime.cpu_core import ACTIVATIONS, CoreError, _check, _ffi, _lib


def old_as_cpu(t, dtype, name, ndim):
    """cpu_core._as_cpu before commit cpu16."""
    if not isinstance(t, torch.Tensor):
        raise CoreError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise CoreError(f"{name} is on {t.device}; the CPU core needs it on the CPU")
    if t.dim() != ndim:
        raise CoreError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def old_moe_ffn(core, gud, fmt, n_expert, n_ff, n_embd, x, topk_ids, topk_w, threshold=None):
    """CpuCore.moe_ffn before commit cpu16 (same checks, same order)."""
    activation = "silu"
    if core._pool is None:
        raise CoreError("CpuCore is closed: create a new one")
    if activation not in ACTIVATIONS:
        raise CoreError("unknown activation")
    if not isinstance(gud, np.ndarray) or not gud.flags.c_contiguous:
        raise CoreError("expert weights must be a C-contiguous numpy array (the mmap view)")
    x = old_as_cpu(x, torch.float32, "x", 2)
    topk_w = old_as_cpu(topk_w, torch.float32, "topk_w", 2)
    topk_ids = old_as_cpu(topk_ids, torch.int32, "topk_ids", 2)
    n_tokens, k = topk_ids.shape
    if x.shape != (n_tokens, n_embd) or topk_w.shape != (n_tokens, k):
        raise CoreError("shape mismatch")
    y = torch.empty((n_tokens, n_embd), dtype=torch.float32)
    n_active = _ffi.new("int64_t *")
    weights = _ffi.from_buffer(gud)
    _check(
        _lib().pyrt_moe_ffn(
            core._pool,
            weights,
            gud.nbytes,
            fmt,
            n_expert,
            n_ff,
            n_embd,
            _ffi.cast("const float *", x.data_ptr()),
            n_tokens,
            _ffi.cast("const int32_t *", topk_ids.data_ptr()),
            _ffi.cast("const float *", topk_w.data_ptr()),
            k,
            ACTIVATIONS[activation],
            0.0 if threshold is None else float(threshold),
            _ffi.cast("float *", y.data_ptr()),
            n_active,
        ),
        "pyrt_moe_ffn",
    )
    return y, int(n_active[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="olmoe-1b-7b", choices=list(SHAPES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--footprint-gib", type=float, default=2.0)
    args = p.parse_args()
    n_embd, n_ff, n_expert, k = SHAPES[args.shape]
    fmt = FMTS["Q8_0"]
    core = cpu_core.CpuCore(args.threads)
    layers = layer_copies("Q8_0", SHAPES[args.shape], args.footprint_gib)
    gen = torch.Generator().manual_seed(7)
    inputs = [
        (
            torch.randperm(n_expert, generator=gen)[:k].int()[None],
            torch.rand(1, k, generator=gen),
            torch.randn(1, n_embd, generator=gen),
        )
        for _ in range(args.calls)
    ]
    lib = _lib()
    bufs = [_ffi.from_buffer(g) for g in layers]
    y = torch.empty(1, n_embd)
    n_active = _ffi.new("int64_t *")
    raw_args = [
        (
            _ffi.cast("const float *", x.data_ptr()),
            _ffi.cast("const int32_t *", ids.data_ptr()),
            _ffi.cast("const float *", w.data_ptr()),
        )
        for ids, w, x in inputs
    ]
    yp = _ffi.cast("float *", y.data_ptr())

    def run_new(i, g):
        ids, w, x = inputs[i]
        core.moe_ffn(layers[g], fmt, n_expert, n_ff, n_embd, x, ids, w)

    def run_old(i, g):
        ids, w, x = inputs[i]
        old_moe_ffn(core, layers[g], fmt, n_expert, n_ff, n_embd, x, ids, w)

    def run_raw(i, g):
        xp, ip, wp = raw_args[i]
        lib.pyrt_moe_ffn(
            core._pool, bufs[g], layers[g].nbytes, fmt, n_expert, n_ff, n_embd, xp, 1, ip, wp,
            k, 0, 0.0, yp, n_active,
        )  # fmt: skip

    variants = {"wrapper (new)": run_new, "wrapper (old)": run_old, "bare cffi call": run_raw}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            if os.environ.get("PYRT_PROFILE"):  # set to --calls: the kernel's report follows
                print(f"profile of: {name}", file=sys.stderr, flush=True)
            ts = []
            for i in range(args.calls):
                t = time.perf_counter()
                fn(i, i % len(layers))
                ts.append(time.perf_counter() - t)
            times[name].append(statistics.median(ts[3:]) * 1e6)
    print(
        f"{args.shape} Q8_0 batch 1 dense, {core.threads} threads, {args.rounds} rounds of "
        f"{args.calls} calls per variant (median us per call; per-round medians)"
    )
    for name, v in times.items():
        print(f"  {name:16s} {statistics.median(v):8.1f} us   [{', '.join(f'{t:.1f}' for t in v)}]")
    core.close()


if __name__ == "__main__":
    main()
