"""How fast does the CPU read a prompt (prefill), against its arithmetic floor, per chunk size,
and against the reference path it replaced?

A random-weight GGUF of a real model's shape (bench/make_random_gguf.py, made once) is loaded
with the C core. Per cell, a prompt of P random tokens is prefilled into an empty cache with
`forward(prompt, last_only=True)`: one pyrt_decoder_prefill call in chunks of U tokens
(--ubatch; 'default' is the C core's), dense or with neuron thresholds (--thresholds: the
skipped fraction is the C prefill's), or with --reference the path it replaced (the reference
math of pyruntime/model/reference.py with the C core's pyrt_linear and pyrt_moe_ffn, torch for
attention and norms). Cells run in turn within each round (interleaved, never sequential), each
after one untimed run; the table gives tokens/s as the median (min-max) over rounds and each
cell against the first U of its P as the median of the per-round ratios, by the wall clock and
by this process's CPU time (steadier on a shared machine at -t 1; at more threads it counts the
pool's spinning too).

The floor: FLOPs per token / the peak of a plain f32 matmul (torch.mm, 1024^3, the same thread
count) measured in the same run, between rounds. FLOPs per token: 2 per weight element a token
multiplies (q/k/v/o, router, shared expert or dense FFN, the k routed experts' three rows per
neuron), plus attention's 4 * n_head * head_dim per cached position at the mean position
((P - 1) / 2), plus the output matrix once per prompt (its share per token). Q8_0 / Q4_0 dots
run on int8 units whose peak is higher than f32's, so % of the f32 peak can pass 100.

    python bench/cpu_prefill.py granite-1b-a400m --outtype q8_0 -p 128 512 --ubatch 64 128 256 512
    python bench/cpu_prefill.py tiny-olmoe --gguf DEMO.gguf -p 128 512 --reference
    python bench/cpu_prefill.py granite-1b-a400m -t 1 -p 512 --thresholds 0 0.2 0.5
    python bench/cpu_prefill.py granite-1b-a400m -t 1 -p 512 --thresholds 0.2 0.5 \
        --param prefill_union_pct=90,101
    python bench/cpu_prefill.py olmoe-1b-7b -t 16 -p 512 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_gguf import CONFIGS, make_random_gguf  # noqa: E402

from pyruntime.cpu import core as cpu_core  # noqa: E402
from pyruntime.cpu.executor import CpuExecutor  # noqa: E402
from pyruntime.cpu.experts import CpuCoreBackend  # noqa: E402
from pyruntime.gguf.file import open_gguf  # noqa: E402


def flops_per_token(model: CpuExecutor, n_prompt: int) -> float:
    """Multiply-adds x 2 one prompt token costs (module docstring)."""
    cfg = model.config

    def elems(m) -> int:
        return 0 if m is None else m.shape[0] * m.shape[1]

    total = 0.0
    for blk in model.weights.blocks:
        total += 2 * sum(elems(m) for m in (blk.wq, blk.wk, blk.wv, blk.wo))
        total += 4 * cfg.n_head * cfg.head_dim * (n_prompt - 1) / 2  # q.k and p.v
        if blk.experts is not None:
            total += 2 * elems(blk.router)
            total += 2 * cfg.n_expert_used * 3 * cfg.n_ff_exp * cfg.n_embd
            if blk.shared is not None:
                total += 2 * sum(
                    elems(m) for m in (blk.shared.gate, blk.shared.up, blk.shared.down)
                )
        else:
            f = blk.dense_ffn
            total += 2 * sum(elems(m) for m in (f.gate, f.up, f.down))
    return total + 2 * elems(model.weights.output) / n_prompt


def matmul_peak(threads: int, n: int = 1024, reps: int = 5) -> float:
    """GFLOP/s of torch.mm on f32 [n, n] x [n, n] with `threads` threads (best of reps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def prefill_seconds(
    model: CpuExecutor, prompt: torch.Tensor, reference: bool
) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one prefill into an empty cache."""
    cache = model.new_cache(len(prompt))
    t, c = time.perf_counter(), time.process_time()
    if reference:
        model._forward_torch(prompt, cache, True)
    else:
        model.forward(prompt, cache, last_only=True)
    return time.perf_counter() - t, time.process_time() - c


def span(values: list[float], fmt: str) -> str:
    mid, lo, hi = (format(v, fmt) for v in (statistics.median(values), min(values), max(values)))
    return f"{mid} ({lo}-{hi})"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("shape", choices=sorted(CONFIGS), help="real model shape")
    ap.add_argument("--outtype", default="q8_0", help="weight type of the random GGUF")
    ap.add_argument("--gguf", type=Path, help="the GGUF (made when missing; default in /tmp)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("-p", "--prompt", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--ubatch", nargs="+", default=["default"],
                    help="chunk sizes (tokens), or 'default'")  # fmt: skip
    ap.add_argument("--reference", action="store_true",
                    help="also time the reference path (slow on big prompts)")  # fmt: skip
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.0], metavar="T",
                    help="neuron thresholds (the same for every layer; 0: dense), each its own "
                    "cells")  # fmt: skip
    ap.add_argument("--param", metavar="NAME=V1[,V2...]",
                    help="a C core execution parameter (pyrt_params), each value its own pool and "
                    "cells, e.g. prefill_union_pct=90,101")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ubatches = [None if u == "default" else int(u) for u in args.ubatch]
    knob, values = None, [None]
    if args.param:
        knob, _, text = args.param.partition("=")
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            ap.error(f"--param takes NAME=INTEGER[,INTEGER...], got {args.param!r}")

    path = args.gguf or Path(f"/tmp/{args.shape}-{args.outtype}.gguf")
    if not path.exists():
        t = time.perf_counter()
        make_random_gguf(args.shape, path, args.outtype, progress=False)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
              f"{time.perf_counter() - t:.0f} s")  # fmt: skip
    f = open_gguf(path)
    models = {}
    for v in values:
        model = models[v] = CpuExecutor.from_gguf(f, expert_backend="torch")
        model.expert_backend = CpuCoreBackend(args.threads, None if knob is None else {knob: v})
        model.use_core(model.expert_backend.core)
    model.core.mem_read(f._map)  # every page mapped once: no first-touch faults in the timings
    threads = model.core.threads
    gen = torch.Generator().manual_seed(0)
    prompts = {p: torch.randint(0, model.config.n_vocab, (p,), generator=gen) for p in args.prompt}
    cells = [(p, u, False, t, v) for p in args.prompt for t in args.thresholds for u in ubatches
             for v in values]  # fmt: skip
    if args.reference:
        cells += [(p, None, True, t, values[0]) for p in args.prompt for t in args.thresholds]
    cells.sort(key=lambda c: c[0])
    times: dict[tuple, list[tuple[float, float]]] = {}
    skipped: dict[float, float] = {}  # threshold -> fraction of neurons skipped (C prefill)
    peaks = [matmul_peak(threads)]
    for rnd in range(args.rounds):
        for p, u, ref, thr, v in cells:
            model = models[v]
            model.ubatch = u
            model.expert_threshold = [thr] * model.config.n_layer if thr > 0 else None
            prefill_seconds(model, prompts[p], ref)  # warm: this chunk size's buffers
            model.stats.reset()
            times.setdefault((p, u, ref, thr, v), []).append(
                prefill_seconds(model, prompts[p], ref)
            )
            skipped[thr] = model.stats.phase_sparsity("prefill") or 0.0
        peaks.append(matmul_peak(threads))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    peak = statistics.median(peaks)
    print(f"{path.name}: {platform.processor() or platform.machine()}, {threads} threads, simd "
          f"{cpu_core.simd_level()}, load average {os.getloadavg()[0]:.2f}; f32 matmul peak "
          f"{span(peaks, '.0f')} GFLOP/s")  # fmt: skip
    print(f"\n| pp | path | threshold (skipped) | ubatch | {knob or 'params'} | tokens/s | vs "
          "first | tokens per CPU-s | vs first | floor tokens/s | % of f32 peak |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in args.prompt:
        first = times[cells[[c[0] for c in cells].index(p)]]
        floor = peak * 1e9 / flops_per_token(model, p)
        for (cp, u, ref, thr, v), ts in times.items():
            if cp != p:
                continue
            rates = [p / w for w, _ in ts]
            cpu_rates = [p / c for _, c in ts]
            ratio = [a[0] / b[0] for a, b in zip(first, ts, strict=True)]
            cpu_ratio = [a[1] / b[1] for a, b in zip(first, ts, strict=True)]
            path_name = "reference" if ref else "C prefill"
            shown = "-" if ref else (u or f"default ({cpu_core.ubatch_default()})")
            print(f"| {p} | {path_name} | {thr} ({skipped[thr]:.2f}) | {shown} | "
                  f"{'default' if v is None else v} | "
                  f"{span(rates, '.1f')} | "
                  f"{statistics.median(ratio):.2f}x | {span(cpu_rates, '.1f')} | "
                  f"{statistics.median(cpu_ratio):.2f}x | {floor:.1f} | "
                  f"{statistics.median(rates) / floor * 100:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
