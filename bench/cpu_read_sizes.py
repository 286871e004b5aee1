"""The DRAM read test (pyrt_mem_read) against the size of the buffer it reads.

A read test whose buffer is not much larger than the last-level cache may measure partly the
cache: the device CPU reports a 300 MiB L3 (this box 480 MiB), and an L3 that kept part of a
buffer read over and over (as a thrash-resistant replacement policy can) would make a 1 GiB test
read faster than DRAM delivers to a kernel that streams through several GiB of expert copies (on
the device it does not: docs/benchmarks.md, "The read test is not inflated by the L3"). This prints
the read rate per buffer size, the sizes interleaved over rounds (so drift hits all alike),
median over rounds of each round's median of --reads reads.

    PYTHONPATH=. python bench/cpu_read_sizes.py --gib 0.5 1 2 4 8 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_experts import ReadTest  # noqa: E402

from pyruntime.cpu import core as cpu_core  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", nargs="+", type=float, default=[0.5, 1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reads", type=int, default=3, help="reads of a buffer per round")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    args = p.parse_args()
    core = cpu_core.CpuCore(args.threads)
    tests = {g: ReadTest(core, g) for g in args.gib}
    rates: dict[float, list[float]] = {g: [] for g in args.gib}
    for _ in range(args.rounds):
        for g, test in tests.items():
            rates[g].append(statistics.median(test.rates(args.reads)))
    print(f"{core.threads} threads, {args.rounds} rounds of {args.reads} reads per size\n")
    print("| buffer GiB | median GB/s | min-max of the round medians |")
    print("|---|---|---|")
    for g, v in rates.items():
        print(f"| {g:g} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |")
    core.close()


if __name__ == "__main__":
    main()
