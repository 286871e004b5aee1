"""What the Python wrapper adds to a pyrt_moe_ffn call: CpuCore.moe_ffn (with a new output tensor
per call, and with out= reusing one) against the bare cffi call with every pointer made beforehand
(the floor). One process, variants interleaved per
round, each round `--calls` back-to-back calls per variant on layer copies cycled from DRAM,
fresh random routing per call (as bench/cpu_experts.py); prints median us per call. (Its first
version, bench/cpu16_overhead.py at commit 9bcc102, also timed a copy of the wrapper as it was
before that work.)

    PYTHONPATH=. python bench/cpu_wrapper_overhead.py --shape olmoe-1b-7b --rounds 5

With PYRT_PROFILE set to --calls, the kernel's profile of each variant's round (C-side entry and
call time) follows that variant's label on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.cpu_experts import FMTS, SHAPES, layer_copies
from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.core import _ffi, _lib


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

    def run_out(i, g):
        ids, w, x = inputs[i]
        core.moe_ffn(layers[g], fmt, n_expert, n_ff, n_embd, x, ids, w, out=y)

    def run_raw(i, g):
        xp, ip, wp = raw_args[i]
        lib.pyrt_moe_ffn(
            core._pool, bufs[g], layers[g].nbytes, fmt, n_expert, n_ff, n_embd, xp, 1, ip, wp,
            k, 0, 0.0, yp, n_active,
        )  # fmt: skip

    variants = {
        "CpuCore.moe_ffn": run_new,
        "moe_ffn(out=y)": run_out,
        "bare cffi call": run_raw,
    }
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
