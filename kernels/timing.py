"""CUDA timing pieces shared by the dense/sparse switch (kernels.switch) and the GPU benchmarks
(bench/moe_layer.py, bench/sweep_q8r.py, bench/gpu_decode.py): warm up and capture a call in a
CUDA graph, evict the L2 before a timed call, time calls with CUDA events, measure the HBM read
bandwidth.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable, Iterator

import torch


def warm_up(fn: Callable[[], object], n: int = 3) -> None:
    """Run fn n times on a side stream (Triton compiles and allocations happen outside a later
    capture), then make the current stream wait for it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """torch.cuda.graph(graph, pool=pool) with Python's cyclic garbage collector off inside.
    A collection that runs mid-capture (any allocation may start one) finalizes whatever became
    garbage since (an executor's registered host memory, pinned buffers, events), and those
    finalizers' CUDA calls are not permitted while the stream captures: the capture was
    invalidated, "operation failed due to a previous error during capture", in whichever
    graph a test happened to capture when a collection came (a gpt-oss hybrid after another
    test in the same process, one run in two on an H100; with the collector off, or in
    torch's "relaxed" capture mode, both passed). torch.cuda.graph collects before it begins."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (warm it up first); replay() reruns it."""
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        fn()
    return graph


def l2_evictor(device) -> Callable[[], object]:
    """A call that evicts the GPU's L2 (50 MB on an H100) by reading 256 MiB, to run before a
    timed call so its weights come from HBM. A read, not a write: a write (zero_) leaves the L2
    full of dirty lines that the timed call then writes back to HBM, slowing most the path that
    reads the most bytes (it biased the dense/sparse switch toward sparse)."""
    buf = torch.ones(2**26, dtype=torch.float32, device=device)
    return buf.sum


def event_seconds(
    fn: Callable[[], object], reps: int, before: Callable[[int], object] | None = None
) -> list[float]:
    """Seconds of each of `reps` calls of fn, timed with CUDA events on the current stream and
    synchronized after each; before(i) (an L2 flush, a new routing) runs ahead of call i,
    outside its interval."""
    times = []
    for i in range(reps):
        if before is not None:
            before(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return times


def hbm_read_bandwidth(device, n_bytes: int = 2**31, reps: int = 20) -> float:
    """Measured HBM read bandwidth in bytes/s: the median time of torch.sum over an n_bytes
    bf16 tensor (after 3 warm-up sums)."""
    a = torch.ones(n_bytes // 2, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a.sum()
    return n_bytes / statistics.median(event_seconds(a.sum, reps))
