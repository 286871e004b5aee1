"""Does CPU decode survive a busy machine? Decode speed at several thread counts, on an idle
machine and beside competing busy processes, interleaved.

A laptop always runs something else. A thread pool that spin-waits for its slowest thread then
collapses: a worker whose core another process holds starts each task a scheduler slice late,
and every task of every layer waits for it (issue 20: 3,654 tok/s with -t 1 and 97 with -t 2 on
a loaded 2-core machine). This tool measures it: per round, for each condition (idle, then
`--load N` processes each spinning `while 1: pass`, default one per physical core), each thread
count decodes --tokens greedy tokens (the C decode step, after a short prompt) on its own
pool, the counts in turn. The competitors start before a condition's cells and are killed after
them, so each cell of a round runs under the same load. The table gives tokens/s per cell
(median and min-max over rounds) and, per condition, each count against the first (-t 1 by
default) as the median (min-max) of the per-round ratios.

    python bench/cpu_load.py                                   # the demo model, -t 1 vs default
    python bench/cpu_load.py --gguf /tmp/granite-q8_0.gguf --threads 1 2 --rounds 5
    python bench/cpu_load.py --param spin_us=50               # a C core execution parameter
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime

from pyruntime.cpu import core as cpu_core  # noqa: E402
from pyruntime.cpu.executor import CpuExecutor  # noqa: E402
from pyruntime.cpu.experts import CpuCoreBackend  # noqa: E402
from pyruntime.gguf.file import open_gguf  # noqa: E402
from pyruntime.tools.demo import demo_model_path  # noqa: E402

BUSY = "while 1: pass"


def start_load(n: int) -> list[subprocess.Popen]:
    """n processes that spin on a CPU each, until stop_load."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    time.sleep(0.3)  # let them reach their loop and the scheduler spread them
    return procs


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def load_model(path: Path, threads: int, params: dict[str, int]) -> CpuExecutor:
    model = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")
    model.expert_backend = CpuCoreBackend(threads, params)
    model.use_core(model.expert_backend.core)
    return model


def decode_rate(model: CpuExecutor, n_prompt: int, n_tokens: int) -> float:
    """Tokens/s of n_tokens greedy C decode steps after a random prompt."""
    cache = model.new_cache(n_prompt + n_tokens + 1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.n_vocab, (n_prompt,), generator=gen)
    tok = int(model.forward(prompt, cache, last_only=True)[-1].argmax())
    tok = int(model.forward([tok], cache)[-1].argmax())  # one untimed step
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        tok = int(model.forward([tok], cache)[-1].argmax())
    return n_tokens / (time.perf_counter() - t0)


def span(values: list[float], fmt: str) -> str:
    mid, lo, hi = (format(v, fmt) for v in (statistics.median(values), min(values), max(values)))
    return f"{mid} ({lo}-{hi})"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gguf", type=Path, help="the model (default: the demo model)")
    physical = cpu_core.physical_cores()
    ap.add_argument(
        "--threads", type=int, nargs="+", default=None,
        help=f"thread counts, the first the reference (default: 1 {physical}, the default count)",
    )  # fmt: skip
    ap.add_argument("--load", type=int, default=physical, help="busy competitor processes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per cell")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="a C core execution parameter (pyrt_params), e.g. spin_us=50")  # fmt: skip
    args = ap.parse_args()
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            ap.error(f"--param takes NAME=INTEGER, got {item!r}")
        params[name] = int(value)
    threads = args.threads or [1, physical]
    path = args.gguf or demo_model_path(quiet=True)
    models = {t: load_model(path, t, params) for t in threads}
    conditions = [("idle", 0), (f"{args.load} busy", args.load)]
    rates: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for name, n_busy in conditions:
            procs = start_load(n_busy)
            try:
                for t in threads:
                    rate = decode_rate(models[t], args.prompt, args.tokens)
                    rates.setdefault((name, t), []).append(rate)
            finally:
                stop_load(procs)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    print(f"{path.name}: {physical} physical cores, {cpu_core.logical_cpus()} CPUs, load "
          f"average {load:.2f} after the run; params {params or 'default'}")  # fmt: skip
    print(f"\n| condition | threads | tokens/s | vs -t {threads[0]} (per-round ratio) |")
    print("|---|---:|---:|---:|")
    for name, _ in conditions:
        ref = rates[(name, threads[0])]
        for t in threads:
            got = rates[(name, t)]
            ratio = [g / r for g, r in zip(got, ref, strict=True)]
            print(f"| {name} | {t} | {span(got, '.1f')} | {span(ratio, '.2f')}x |")


if __name__ == "__main__":
    main()
