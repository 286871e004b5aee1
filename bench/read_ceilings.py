"""How many bytes per second can this machine read from DRAM, and copy from host to GPU? The
ceilings the other benches divide by.

DRAM (the default): the C core's stream read (pyrt_mem_read, on its thread pool, the read test of
bench/cpu_experts.py and bench/cpu_decode.py) against the size of the buffer it reads. A read
test whose buffer is not much larger than the last-level cache may measure partly the cache, so
the sizes are interleaved over rounds (drift hits all alike), median over rounds of each round's
median of --reads reads.

--h2d: host-to-GPU copies of one buffer (torch, wall clock around synchronized copies): from
pinned memory, from pageable memory, and pinned again while the C core reads DRAM on every core
at the same time (both share the DRAM, which is what an expert staged to the GPU and an expert
computed on the CPU compete for): the rates of the copy and of the read side by side.

    python bench/read_ceilings.py --gib 0.5 1 2 4 8 --rounds 7
    python bench/read_ceilings.py --h2d --gib 4 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_experts import ReadTest  # noqa: E402

from pyruntime.cpu import core as cpu_core  # noqa: E402


def read_sizes(core: cpu_core.CpuCore, gibs: list[float], rounds: int, reads: int) -> None:
    tests = {g: ReadTest(core, g) for g in gibs}
    rates: dict[float, list[float]] = {g: [] for g in gibs}
    for _ in range(rounds):
        for g, test in tests.items():
            rates[g].append(statistics.median(test.rates(reads)))
    print(f"DRAM read, {core.threads} threads, {rounds} rounds of {reads} reads per size\n")
    print("| buffer GiB | median GB/s | min-max of the round medians |")
    print("|---|---|---|")
    for g, v in rates.items():
        print(f"| {g:g} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |")


def h2d(core: cpu_core.CpuCore, gib: float, rounds: int) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--h2d needs a CUDA GPU")
    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(n, dtype=torch.uint8).fill_(1)
    read = ReadTest(core, gib)
    rates: dict[str, list[float]] = {"pinned": [], "pageable": [], "pinned + read": [], "read": []}
    for _ in range(rounds):  # the three measures interleaved
        for name, src in (("pinned", pinned), ("pageable", pageable)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates[name].append(n / (time.perf_counter() - t) / 1e9)
        copy_gbs, read_gbs = copy_while_reading(dev, pinned, read)
        rates["pinned + read"].append(copy_gbs)
        rates["read"].append(read_gbs)
    print(f"host -> {torch.cuda.get_device_name()}, {gib:g} GiB buffers, {rounds} rounds; "
          f"DRAM read by {core.threads} threads\n")  # fmt: skip
    print("| measure | median GB/s | min-max |\n|---|---|---|")
    for name, label in (
        ("pinned", "copy from pinned memory, alone"),
        ("pageable", "copy from pageable memory, alone"),
        ("pinned + read", "copy from pinned memory, during the DRAM read"),
        ("read", "DRAM read (pyrt_mem_read), during the copy"),
    ):
        v = rates[name]
        print(f"| {label} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |")
    both = [a + b for a, b in zip(rates["pinned + read"], rates["read"], strict=True)]
    print(f"| copy + read at once, in all | {statistics.median(both):.1f} "
          f"| {min(both):.1f}-{max(both):.1f} |")  # fmt: skip


def copy_while_reading(dev, pinned, read: ReadTest, copies: int = 4) -> tuple[float, float]:
    """(copy GB/s, read GB/s) of `copies` pinned copies queued on a side stream while this thread
    runs the read test until the last copy is done (reads that end after it still count, so the
    read rate is a slight underestimate of the overlap)."""
    import torch

    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(copies):
            dev.copy_(pinned, non_blocking=True)
        end.record()
    read_bytes, t = 0, time.perf_counter()
    while not end.query():
        read.core.mem_read(read.buf)
        read_bytes += read.buf.nbytes
    read_s = time.perf_counter() - t
    end.synchronize()
    copy_s = start.elapsed_time(end) / 1e3
    return copies * pinned.numel() / copy_s / 1e9, read_bytes / read_s / 1e9


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gib", nargs="+", type=float, default=[0.5, 1, 2, 4, 8],
                   help="buffer sizes (--h2d: the first)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reads", type=int, default=3, help="reads of a buffer per round")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--h2d", action="store_true", help="host-to-GPU copies instead (see above)")
    args = p.parse_args()
    with cpu_core.CpuCore(args.threads) as core:
        if args.h2d:
            h2d(core, args.gib[0], args.rounds)
        else:
            read_sizes(core, args.gib, args.rounds, args.reads)


if __name__ == "__main__":
    main()
