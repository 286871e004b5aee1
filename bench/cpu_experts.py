"""How fast are one MoE layer's routed experts on the C core, against this machine's DRAM read?

For each real MoE shape: one layer of random routed experts in the neuron-contiguous layout
(docs/gguf-layout.md), batch 1 and 8, dense and at target sparsities (thresholds chosen as quantiles
of |act(gate . x)| so the target fraction of neurons is skipped), timed with fresh random routing
every call so the experts come from DRAM, not cache. Bytes per call are the rows the kernel must
read: the gate rows of every routed expert, plus the up and down rows of the active neurons
(counted once per expert for dense; for sparse at batch > 1 a row shared by two tokens of one
expert is counted twice, so sparse batch-8 bytes/s is an upper bound). The DRAM read test
(pyrt_mem_read) runs on the same thread pool.

    python bench/cpu_experts.py            # both shapes, Q8_0, all cores
    python bench/cpu_experts.py --shapes olmoe-1b-7b --formats Q8_0 Q4_0 --threads 1

--huge-pages puts the layer copies and the read test's buffer on 2 MiB pages (THP by madvise), as
a decode with `--weights-copy` reads its weights (else numpy's allocation: 4 KiB pages here). The
shape granite-in-cache (granite's rows, a layer small enough for L2, with --footprint-gib 0)
gives the same calls with no DRAM stream: the kernels' and the driver's in-cache time per neuron.

--sweep times settings against each other in one process, on the first shape and format, every
combination in turn for --rounds rounds (so drift hits all alike; each round starts one
combination further on, so none always runs first), median of the rounds' medians; each round
starts with 3 reads of the read test, and a last table pairs each cell with its round's read
rate (dense: % of it; sparse: the dense cell's time over the sparse cell's). Two copies of one
build differed by up to 9% over 3-4 rounds at 16 threads and by 1% over 30 (bench/README.md):
use --rounds 30, and time a build against a copy of itself to see what a sweep can tell apart:

    python bench/cpu_experts.py --sweep expert_prefetch_neurons=2,1 reduce_prefetch_items=2,6

A lower-case name is one of the C core's execution parameters (pyrt_params in
runtime/include/pyrt.h; each setting gets its own pool); SIMD is the SIMD level
(cpu_core.force_simd), e.g. SIMD=avx2,avx512; LIB is a libpyrt build (path) of the same C API,
so two builds are timed against each other in one process, interleaved, e.g.
LIB=/tmp/old/libpyrt.so,/tmp/new/libpyrt.so (see Pools).

Every cell alternates calls through the Python wrapper (CpuCore.moe_ffn) with bare cffi calls whose
pointers were made beforehand, --iters timed calls of each: the tables give both, the bare call
being the kernel alone (the wrapper adds argument checks, an output tensor and cffi casts, and
runs with the interpreter's lines streamed out of the caches by the call before).
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
from pyruntime.cpu import core as cpu_core  # noqa: E402
from pyruntime.gguf.file import huge_page_array  # noqa: E402

# (n_embd, n_ff per expert, n_expert, top-k), from the models' config.json
SHAPES = {
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "granite-1b-a400m": (1024, 512, 32, 8),
    # granite's rows, 8 experts of 64 neurons: a layer of 0.9 MB (Q4_K) to 1.7 MB (Q8_0), in a
    # 2 MiB L2 after the first call: the kernels' and the driver's time per neuron, no DRAM stream
    "granite-in-cache": (1024, 64, 8, 8),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    # olmoe's rows, 4x its neurons a call (16 experts of 4,096, top-8): the per-call costs (the
    # pool's fork and join, the partial ys' sum) amortized over 4x the weights
    "olmoe-wide4": (2048, 4096, 16, 8),
}
FMTS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
# K-quant super-blocks (256 weights): bytes, and the offsets of their f16 scales (d, dmin)
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def random_layer(fmt: str, n_expert: int, n_ff: int, n_embd: int, seed: int = 0) -> np.ndarray:
    """Random bytes of one ffn_gud_exps tensor: valid blocks, uniform quants, a fixed scale."""
    rng = np.random.default_rng(seed)
    n_rows = n_expert * n_ff * 3
    if fmt in ("Q8_0", "Q4_0"):
        block = 34 if fmt == "Q8_0" else 18
        raw = rng.integers(0, 256, size=(n_rows, n_embd // 32, block), dtype=np.uint8)
        scale = 0.002 if fmt == "Q8_0" else 0.03  # weights of std ~0.15 either way
        raw[:, :, 0:2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        return raw.reshape(-1)
    if fmt in K_BLOCKS:  # random codes and sub-block scales, f16 scales of weights ~0.15
        size, at = K_BLOCKS[fmt]
        raw = rng.integers(0, 256, size=(n_rows, n_embd // 256, size), dtype=np.uint8)
        scale = np.float16({"Q4_K": 0.0003, "Q5_K": 0.00015, "Q6_K": 0.00015}[fmt]).tobytes()
        for a in at:
            raw[:, :, a : a + 2] = np.frombuffer(scale, np.uint8)
        return raw.reshape(-1)
    vals = rng.standard_normal((n_rows, n_embd), dtype=np.float32) * 0.15
    return np.ascontiguousarray(gguf.quants.quantize(vals, gguf.GGMLQuantizationType(FMTS[fmt])))


def act_quantiles(gud, fmt, n_ff, n_embd, targets, seed=1):
    """|act(gate . x)| at the target quantiles, sampled over 4 experts and 16 random tokens."""
    qtype = gguf.GGMLQuantizationType(FMTS[fmt])
    rb = cpu_core.row_bytes(FMTS[fmt], n_embd)
    raw = gud.reshape(-1)[: 4 * n_ff * 3 * rb].view(np.uint8).reshape(4 * n_ff * 3, rb)
    if fmt in ("F32", "F16", "BF16"):
        raw = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint8}[fmt])
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(4, n_ff, 3, n_embd).copy())
    x = torch.randn(16, n_embd, generator=torch.Generator().manual_seed(seed))
    a = torch.nn.functional.silu(torch.einsum("efd,td->tef", w[:, :, 0], x)).abs().flatten()
    return {s: float(torch.quantile(a, s)) if s > 0 else 0.0 for s in targets}


class ReadTest:
    """pyrt_mem_read over one buffer of `gib` GiB, made (and faulted in) once, so the test can run
    between the kernel's cells as often as needed."""

    def __init__(self, core: cpu_core.CpuCore, gib: float, huge: bool = False):
        self.core = core
        n = int(gib * 2**30)
        self.buf = huge_page_array(n) if huge else np.empty(n, dtype=np.uint8)
        self.buf.fill(0x5A)  # every page written (DRAM does not care what the bytes are)
        core.mem_read(self.buf)

    def rates(self, iters: int) -> list[float]:
        """GB/s of each of `iters` reads of the whole buffer."""
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            self.core.mem_read(self.buf)
            out.append(self.buf.nbytes / (time.perf_counter() - t) / 1e9)
        return out


def layer_copies(fmt: str, shape, footprint_gib: float, huge: bool = False) -> list[np.ndarray]:
    """One random layer and byte copies of it, footprint_gib GiB in all. Copies, not fresh random
    layers: the kernel reads them from different addresses all the same (DRAM does not care what
    the bytes are), and copying is ~20x faster than generating random bytes. huge: every copy on
    2 MiB pages (as a decode's `--weights-copy`), else as numpy allocates (4 KiB pages here)."""
    n_embd, n_ff, n_expert, _ = shape
    first = random_layer(fmt, n_expert, n_ff, n_embd)
    n_copies = max(1, int(np.ceil(footprint_gib * 2**30 / first.nbytes)))
    if not huge:
        return [first] + [first.copy() for _ in range(n_copies - 1)]
    out = []
    for _ in range(n_copies):
        buf = huge_page_array(first.nbytes).view(first.dtype).reshape(first.shape)
        buf[...] = first
        out.append(buf)
    return out


class Pools:
    """One pool per (libpyrt build, params) in one process: use(path, params) makes cpu_core call
    that build (None: the loaded one; cpu_core keeps one library handle, the builds share the cffi
    declarations, so they must have the same C API) and returns the CpuCore of those params. Each
    build is loaded by path with RTLD_LOCAL, so its calls into itself stay in it. Switching waits
    2 ms, past the other pool's worker spin (params spin_us, 300 us), so idle workers of one pool
    do not spin on the cores the other's work runs on."""

    def __init__(self, threads: int):
        self.threads = threads
        self.first = cpu_core._lib()
        self.handles: dict[str | None, object] = {None: self.first}
        self.cores: dict[tuple, cpu_core.CpuCore] = {}
        self.current: tuple | None = None

    def use(self, path: str | None, params: dict[str, int]) -> cpu_core.CpuCore:
        if path not in self.handles:
            handle = cpu_core._ffi.dlopen(path)
            cpu_core._check_api(handle, Path(path), cpu_core._SOURCE_HEADER)  # same declarations
            self.handles[path] = handle
        cpu_core._lib_handle = self.handles[path]
        key = (path, tuple(sorted(params.items())))
        if key not in self.cores:
            self.cores[key] = cpu_core.CpuCore(self.threads, params=params)
        if self.current != key:
            time.sleep(0.002)
            self.current = key
        return self.cores[key]

    def close(self) -> None:
        for (path, _), core in self.cores.items():
            cpu_core._lib_handle = self.handles[path]
            cpu_core.force_simd(cpu_core.simd_best())  # each build back to its best level
            core.close()
        cpu_core._lib_handle = self.first


def round_order(combos: list, i: int) -> list:
    """The combinations in the order round i runs them: rotated by i, so that none always runs
    first (right after the round's read test) or last."""
    k = i % len(combos)
    return combos[k:] + combos[:k]


def sweep(core, layers, fmt, shape, batches, sparsities, iters, knobs, rounds, bw, read):
    """Every combination of knob values (dict name -> list of strings), interleaved over rounds;
    prints ms per call (median of the rounds' medians) and dense % of DRAM read / sparse speedup,
    first through the Python wrapper, then of the bare C call (the kernel alone), each with its
    spread. Each round starts with 3 reads of the ReadTest `read`, then runs the combinations
    in turn from the round's own starting one; the last table pairs every round's cells with
    that round's read rate (see print_paired)."""
    n_embd, n_ff, _, _ = shape
    thresholds = act_quantiles(layers[0], fmt, n_ff, n_embd, sparsities)
    names = list(knobs)
    combos = list(itertools.product(*(knobs[n] for n in names)))
    pools = Pools(core.threads)
    ms: dict[str, dict[tuple, list[float]]] = {"": {}, "bare_": {}}
    gbs: dict[str, dict[tuple, list[float]]] = {"": {}, "bare_": {}}
    round_bw = []  # GB/s, median of the round's 3 reads
    for i in range(rounds):
        time.sleep(0.002)  # past the other pools' worker spin (see Pools)
        round_bw.append(statistics.median(read.rates(3)))
        for combo in round_order(combos, i):
            setting = dict(zip(names, combo, strict=True))
            lib, simd = setting.pop("LIB", None), setting.pop("SIMD", None)
            cell_core = pools.use(lib, {k: int(v) for k, v in setting.items()})
            if simd is not None:
                cpu_core.force_simd(simd)
            for batch in batches:
                for s in sparsities:
                    r = bench_layer(cell_core, layers, fmt, shape, batch, thresholds[s], iters)
                    for m in ms:
                        ms[m].setdefault((combo, batch, s), []).append(r[m + "ms"])
                        gbs[m].setdefault((combo, batch, s), []).append(r[m + "gbs"])
    pools.close()
    cpu_core.force_simd(cpu_core.simd_best())
    cols = [(b, s) for b in batches for s in sparsities]
    for m, what in (("", "through the Python wrapper"), ("bare_", "bare C call (kernel alone)")):
        print(f"\n{what}:")
        print_table(names, combos, cols, ms[m], gbs[m], bw, 0.0 in sparsities)
        print_spread(names, combos, cols, ms[m])
    print_paired(names, combos, cols, ms["bare_"], gbs["bare_"], round_bw)


def print_head(title, names, cols, unit=""):
    """A table's title line, then its markdown header: the knob names, then b<batch> s<sparsity>
    per cell (with `unit`)."""
    labels = " | ".join(f"b{b} s{s:.1f}{unit}" for b, s in cols)
    print(f"{title}\n\n| {' | '.join(names)} | {labels} |")
    print("|" + "---|" * (len(names) + len(cols)))


def print_row(combo, cells):
    print(f"| {' | '.join(combo)} | {' | '.join(cells)} |", flush=True)


def print_table(names, combos, cols, ms, gbs, bw, has_dense):
    print_head("", names, cols, " ms")
    for combo in combos:
        cells = []
        for b, s in cols:
            m = statistics.median(ms[(combo, b, s)])
            if s == 0:
                g = statistics.median(gbs[(combo, b, s)])
                cells.append(f"{m:.3f} ({100 * g / bw:.0f}%)")
            else:
                dense = statistics.median(ms[(combo, b, 0.0)]) if has_dense else None
                cells.append(f"{m:.3f}" + (f" ({dense / m:.2f}x)" if dense else ""))
        print_row(combo, cells)


def print_spread(names, combos, cols, ms):
    """The sweep's spread: per cell, the lowest and highest of the rounds' medians (ms), and for
    every combination after the first the median over rounds of its ms / the first's ms in the same
    round (rounds are interleaved, so this ratio pairs measurements taken close in time)."""
    print_head(
        "\nspread: min-max of the round medians (ms); ratio = median over rounds of ms / "
        "first combination's ms in the same round",
        names,
        cols,
    )
    for combo in combos:
        cells = []
        for b, s in cols:
            v = ms[(combo, b, s)]
            cell = f"{min(v):.3f}-{max(v):.3f}"
            if combo != combos[0]:
                ref = ms[(combos[0], b, s)]
                cell += f" ({statistics.median(x / r for x, r in zip(v, ref, strict=True)):.3f})"
            cells.append(cell)
        print_row(combo, cells)


def print_paired(names, combos, cols, ms, gbs, round_bw):
    """Bare C call, each round against itself: dense cells as % of that round's read test, sparse
    cells as the speedup over the same combination's dense cell of that round; median over the
    rounds, then (min-max). Drift of the machine between rounds cancels in these ratios."""
    print_head(
        f"\nbare C call, paired within each round (read tests per round, GB/s: "
        f"{', '.join(f'{b:.1f}' for b in round_bw)}): dense = % of the round's read test, "
        f"sparse = dense ms / sparse ms of the round; median (min-max) over rounds",
        names,
        cols,
    )
    for combo in combos:
        cells = []
        for b, s in cols:
            if s == 0:
                v = [100 * g / r for g, r in zip(gbs[(combo, b, s)], round_bw, strict=True)]
                fmt_v = "{:.1f}%"
            elif (combo, b, 0.0) in ms:
                v = [d / x for d, x in zip(ms[(combo, b, 0.0)], ms[(combo, b, s)], strict=True)]
                fmt_v = "{:.2f}x"
            else:
                cells.append("-")
                continue
            cells.append(
                f"{fmt_v.format(statistics.median(v))} "
                f"({fmt_v.format(min(v))}-{fmt_v.format(max(v))})"
            )
        print_row(combo, cells)


def bench_layer(core, layers, fmt, shape, batch, threshold, iters, seed=3):
    """Back-to-back calls, each on the next layer copy with fresh random routing (inputs made
    beforehand, so the pool's threads stay awake: this is kernel throughput, see wake_up_us).
    Calls alternate between CpuCore.moe_ffn (the Python wrapper: argument checks, a new output
    tensor, cffi casts) and the bare cffi call with every pointer made beforehand (the kernel
    alone, ~1 us of cffi on top), `iters` timed calls of each after 3 warm-up calls."""
    n_embd, n_ff, n_expert, k = shape
    rb = cpu_core.row_bytes(FMTS[fmt], n_embd)
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(2 * iters + 3):
        ids = torch.stack([torch.randperm(n_expert, generator=gen)[:k] for _ in range(batch)])
        calls.append(
            (
                ids.int(),
                torch.rand(batch, k, generator=gen),
                torch.randn(batch, n_embd, generator=gen),
            )
        )
    ffi, lib = cpu_core._ffi, core._lib
    y = torch.empty(batch, n_embd)
    y_p, n_active_p = ffi.cast("float *", y.data_ptr()), ffi.new("int64_t *")
    experts = [
        ffi.new(
            "pyrt_experts *",
            (ffi.from_buffer(g), g.nbytes, FMTS[fmt], n_expert, n_expert, n_ff, n_embd, ffi.NULL),
        )
        for g in layers
    ]
    bare_args = [
        (
            ffi.cast("const float *", x.data_ptr()),
            ffi.cast("const int32_t *", ids.data_ptr()),
            ffi.cast("const float *", w.data_ptr()),
        )
        for ids, w, x in calls
    ]
    samples = {"wrapper": ([], [], []), "bare": ([], [], [])}  # times, bytes, actives
    for it, (ids, w, x) in enumerate(calls):
        g = it % len(layers)
        gud = layers[g]
        if it % 2 == 0:
            mode = "wrapper"
            t = time.perf_counter()
            _, n_active = core.moe_ffn(
                gud, FMTS[fmt], n_expert, n_ff, n_embd, x, ids, w, threshold=threshold
            )
            dt = time.perf_counter() - t
        else:
            mode = "bare"
            x_p, ids_p, w_p = bare_args[it]
            t = time.perf_counter()
            rc = lib.pyrt_moe_ffn(
                core._pool, experts[g], x_p, batch, ids_p, w_p, k, 0, threshold, y_p, n_active_p
            )
            dt = time.perf_counter() - t
            assert rc == 0, ffi.string(lib.pyrt_last_error())
            n_active = int(n_active_p[0])
        if it < 3:
            continue  # warm-up
        n_unique = len(set(ids.flatten().tolist()))
        up_down = n_unique * n_ff if threshold == 0.0 else n_active
        times, bytes_read, actives = samples[mode]
        times.append(dt)
        bytes_read.append((n_unique * n_ff + 2 * up_down) * rb)
        actives.append(n_active)
    out = {}
    for mode, prefix in (("wrapper", ""), ("bare", "bare_")):
        times, bytes_read, actives = samples[mode]
        out[prefix + "ms"] = statistics.median(times) * 1e3
        rates = (b / t for b, t in zip(bytes_read, times, strict=True))
        out[prefix + "gbs"] = statistics.median(rates) / 1e9
        out[prefix + "sparsity"] = 1 - statistics.mean(actives) / (batch * k * n_ff)
    return out


def wake_up_us(core: cpu_core.CpuCore, iters: int = 20) -> tuple[float, float]:
    """(median us of a tiny call right after another, median us after 5 ms idle): the cost of
    waking the pool's sleeping threads, which a decode step pays once per layer when the rest
    of the layer takes longer than the workers spin."""
    gud = random_layer("F32", 1, 1, 64)
    x, ids, w = torch.randn(1, 64), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    hot, cold = [], []
    for _ in range(iters):
        for sink, pause in ((hot, 0.0), (cold, 0.005)):
            time.sleep(pause)
            t = time.perf_counter()
            core.moe_ffn(gud, 0, 1, 1, 64, x, ids, w)
            sink.append((time.perf_counter() - t) * 1e6)
    return statistics.median(hot), statistics.median(cold)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=["olmoe-1b-7b", "qwen3-30b-a3b"])
    p.add_argument("--formats", nargs="+", default=["Q8_0"], choices=list(FMTS))
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--sparsity", nargs="+", type=float, default=[0.0, 0.5, 0.7, 0.9])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--read-gib", type=float, default=1.0)
    p.add_argument(
        "--sweep",
        nargs="+",
        metavar="KNOB=V1,V2",
        help="time these knob values against each other instead (first shape and format)",
    )
    p.add_argument("--rounds", type=int, default=3, help="--sweep: interleaved rounds")
    p.add_argument(
        "--footprint-gib",
        type=float,
        default=2.0,
        help="copies of the layer cycled through, at least this much memory in all, "
        "so that the experts come from DRAM even with a large L3",
    )
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="the layer copies and the read test's buffer on 2 MiB pages (THP by madvise), "
        "as a decode with --weights-copy reads its weights",
    )
    args = p.parse_args()

    core = cpu_core.CpuCore(args.threads)
    read = ReadTest(core, args.read_gib, args.huge_pages)
    rates = read.rates(max(args.iters, 5))
    bw, bw_best = statistics.median(rates), max(rates)
    print(
        f"machine: {platform.processor() or platform.machine()}, {core.threads} threads, "
        f"SIMD {cpu_core.simd_level()}"
    )
    print(
        f"DRAM read (pyrt_mem_read, {args.read_gib} GiB): median {bw:.2f} GB/s, "
        f"best {bw_best:.2f} GB/s"
    )
    hot, cold = wake_up_us(core)
    print(f"call overhead (tiny call): {hot:.0f} us back to back, {cold:.0f} us after 5 ms idle\n")
    if args.sweep:
        knobs = dict(kv.split("=", 1) for kv in args.sweep)
        shape, fmt = SHAPES[args.shapes[0]], args.formats[0]
        print(f"sweep: {args.shapes[0]} {fmt}, {args.rounds} rounds of {args.iters} calls per cell")
        layers = layer_copies(fmt, shape, args.footprint_gib, args.huge_pages)
        knob_values = {k: v.split(",") for k, v in knobs.items()}
        sweep(
            core,
            layers,
            fmt,
            shape,
            args.batches,
            args.sparsity,
            args.iters,
            knob_values,
            args.rounds,
            bw,
            read,
        )
        del layers
        rates = read.rates(max(args.iters, 5))
        bw2, bw2_best = statistics.median(rates), max(rates)
        print(
            f"\nDRAM read again after the sweep: median {bw2:.2f} GB/s, best {bw2_best:.2f} GB/s "
            f"(the tables use the first, {bw:.2f})"
        )
        core.close()
        return
    print(
        "| shape | fmt | batch | target sparsity | achieved | ms/call | GB/s | % of DRAM read "
        "| speedup vs dense | kernel ms/call | kernel GB/s | kernel % of DRAM read |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        shape = SHAPES[name]
        n_embd, n_ff, n_expert, _ = shape
        for fmt in args.formats:
            layers = layer_copies(fmt, shape, args.footprint_gib, args.huge_pages)
            first = layers[0]
            thresholds = act_quantiles(first, fmt, n_ff, n_embd, args.sparsity)
            for batch in args.batches:
                dense_ms = None
                for s in args.sparsity:
                    r = bench_layer(core, layers, fmt, shape, batch, thresholds[s], args.iters)
                    dense_ms = r["ms"] if s == 0 else dense_ms
                    speedup = f"{dense_ms / r['ms']:.2f}x" if dense_ms else "-"
                    print(
                        f"| {name} | {fmt} | {batch} | {s:.1f} | {r['sparsity']:.3f} "
                        f"| {r['ms']:.2f} | {r['gbs']:.2f} | {100 * r['gbs'] / bw:.0f}% "
                        f"| {speedup} | {r['bare_ms']:.2f} | {r['bare_gbs']:.2f} "
                        f"| {100 * r['bare_gbs'] / bw:.0f}% |",
                        flush=True,
                    )
            del first, layers
    core.close()


if __name__ == "__main__":
    main()
