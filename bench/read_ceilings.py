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
    python bench/read_ceilings.py --zero-copy --gib 1 --rounds 5

--zero-copy: a GPU kernel reading page-locked host memory in place over PCIe (no copy engine, no
launch per expert), from memory the driver allocated and from a read-only file mapping
registered with it (how the GGUF's experts live), alone and while the C core reads DRAM; next to
the pinned copy's rate in the same run. And the round trip of a flag between the CPU and a
spinning GPU kernel through host memory (what a step with no host launches would pay a layer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_experts import ReadTest  # noqa: E402

from pyruntime.cpu import core as cpu_core  # noqa: E402
from pyruntime.offload.host_register import cuda_driver, page_locked  # noqa: E402


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


class HostPtr:
    """A host address Triton may read: an argument with data_ptr() and dtype, as a tensor's
    (Triton resolves it through cuPointerGetAttribute: mapped page-locked memory has one)."""

    def __init__(self, ptr: int, dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def _zero_copy_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(src, out, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # Program p sums words [p * BLOCK * ITERS, (p + 1) * BLOCK * ITERS) of src (int32).
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < n_words, other=0)
        tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))

    @triton.jit
    def ping_pong(cpu_flag, gpu_flag, n, LIMIT: tl.constexpr):
        # For i = 1..n: wait until the CPU wrote i, then write i back (system scope, release).
        for i in range(1, n + 1):
            seen = tl.load(cpu_flag, volatile=True)
            spins = 0
            while (seen != i) & (spins < LIMIT):
                seen = tl.load(cpu_flag, volatile=True)
                spins += 1
            tl.atomic_xchg(gpu_flag, i, sem="release", scope="sys")

    return read_sum, ping_pong


def _device_address(ptr: int) -> int:
    address = cuda_driver().device_pointer(ptr)
    if isinstance(address, str):
        raise SystemExit(f"cuMemHostGetDevicePointer: {address}")
    return address


def _host_buffers(nbytes: int, tmp: Path) -> dict[str, tuple[int, np.ndarray]]:
    """name -> (device address, host array): driver-allocated page-locked memory (mapped,
    host_register.page_locked), and a read-only mapping of a file registered with the driver
    as the GGUF's experts are (host_register.CudaDriver.register: READ_ONLY | DEVICEMAP)."""
    import mmap

    out = {}
    arr = page_locked(nbytes)
    if arr is None:
        raise SystemExit("cuMemHostAlloc refused")
    arr[:] = 1
    out["page-locked (cuMemHostAlloc)"] = (_device_address(arr.ctypes.data), arr)
    path = tmp / "zero_copy.bin"
    with open(path, "wb") as f:
        f.write(np.ones(nbytes, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    view = np.frombuffer(m, dtype=np.uint8)
    why = cuda_driver().register(view.ctypes.data, nbytes, read_only=True)
    if why is not None:
        print(f"registering the file mapping READ_ONLY | DEVICEMAP refused: {why}")
    else:
        out["file mapping, registered read-only"] = (_device_address(view.ctypes.data), view)
    path.unlink()
    return out


def zero_copy(core: cpu_core.CpuCore, gib: float, rounds: int, tmp: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--zero-copy needs a CUDA GPU")
    read_sum, ping_pong = _zero_copy_kernels()
    n = int(gib * 2**30) // 4 * 4
    buffers = _host_buffers(n, tmp)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = buffers["page-locked (cuMemHostAlloc)"][1]
    pinned_t = torch.from_numpy(pinned)
    read = ReadTest(core, gib)
    configs = [(1024, 64, 4), (1024, 64, 8), (2048, 32, 8), (4096, 16, 8), (4096, 64, 16)]
    rates: dict[str, list[float]] = {}

    def kernel_rate(addr: int, block: int, iters: int, warps: int, reps: int = 2) -> float:
        words = n // 4
        grid = triton_cdiv(words, block * iters)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        src = HostPtr(addr, torch.int32)
        read_sum[(grid,)](src, out, words, BLOCK=block, ITERS=iters, num_warps=warps)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            read_sum[(grid,)](src, out, words, BLOCK=block, ITERS=iters, num_warps=warps)
        end.record()
        end.synchronize()
        ref = torch.empty_like(out)  # the same sums from the device copy of the same bytes
        read_sum[(grid,)](dev.view(torch.int32), ref, words, BLOCK=block, ITERS=iters,
                          num_warps=warps)  # fmt: skip
        if not torch.equal(out, ref):
            raise SystemExit(f"the kernel read other bytes from host memory at {addr:#x}")
        return reps * n / (start.elapsed_time(end) / 1e3) / 1e9

    def kernel_while_reading(addr: int, block: int, iters: int, warps: int, reps: int = 6):
        words = n // 4
        grid = triton_cdiv(words, block * iters)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        src = HostPtr(addr, torch.int32)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            read_sum[(grid,)](src, out, words, BLOCK=block, ITERS=iters, num_warps=warps)
        end.record()
        read_bytes, t = 0, time.perf_counter()
        while not end.query():
            core.mem_read(read.buf)
            read_bytes += read.buf.nbytes
        read_s = time.perf_counter() - t
        end.synchronize()
        return reps * n / (start.elapsed_time(end) / 1e3) / 1e9, read_bytes / read_s / 1e9

    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(pinned_t, non_blocking=True)
        torch.cuda.synchronize()
        copy_gbs = n / (time.perf_counter() - t) / 1e9
        rates.setdefault("copy engine, from page-locked memory", []).append(copy_gbs)
        for name, (addr, _) in buffers.items():
            for block, iters, warps in configs:
                key = f"kernel read, {name}, BLOCK {block} x {iters}, {warps} warps"
                rates.setdefault(key, []).append(kernel_rate(addr, block, iters, warps))
        addr = buffers["page-locked (cuMemHostAlloc)"][0]
        k, r = kernel_while_reading(addr, 4096, 16, 8)
        rates.setdefault("kernel read (4096 x 16, 8 warps) during the DRAM read", []).append(k)
        rates.setdefault("DRAM read (pyrt_mem_read), during the kernel read", []).append(r)
        rates.setdefault("kernel + DRAM read at once, in all", []).append(k + r)
    print(f"host memory read by {torch.cuda.get_device_name()} in place, {gib:g} GiB, "
          f"{rounds} rounds; DRAM read by {core.threads} threads\n")  # fmt: skip
    print("| measure | median GB/s | min-max |\n|---|---|---|")
    for name, v in rates.items():
        print(f"| {name} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |")
    # Round trip of a flag: the CPU writes i into mapped host memory, a one-warp kernel spinning
    # on it writes i back, the CPU spins until it sees it.
    flags_ptr = buffers["page-locked (cuMemHostAlloc)"][0]
    flags = pinned[:8].view(np.int32)
    flags[:] = 0
    trips = 2000
    kernel_done = torch.cuda.Event()
    ping_pong[(1,)](HostPtr(flags_ptr, torch.int32), HostPtr(flags_ptr + 4, torch.int32), trips,
                    LIMIT=50_000_000, num_warps=1)  # fmt: skip
    kernel_done.record()
    t = time.perf_counter()
    lost = 0
    for i in range(1, trips + 1):
        flags[0] = i
        deadline = time.perf_counter() + 1.0
        while flags[1] != i:
            if time.perf_counter() > deadline:
                lost += 1
                break
    total = time.perf_counter() - t
    kernel_done.synchronize()
    print(f"\nflag round trip CPU -> spinning kernel -> CPU through mapped host memory: "
          f"{total / trips * 1e6:.2f} us ({trips} trips, {lost} timed out)")  # fmt: skip


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    p.add_argument("--zero-copy", action="store_true",
                   help="a GPU kernel reading host memory in place (see above)")  # fmt: skip
    p.add_argument("--tmp", type=Path, default=Path("/tmp"), help="--zero-copy's file's folder")
    args = p.parse_args()
    with cpu_core.CpuCore(args.threads) as core:
        if args.zero_copy:
            zero_copy(core, args.gib[0], args.rounds, args.tmp)
        elif args.h2d:
            h2d(core, args.gib[0], args.rounds)
        else:
            read_sizes(core, args.gib, args.rounds, args.reads)


if __name__ == "__main__":
    main()
