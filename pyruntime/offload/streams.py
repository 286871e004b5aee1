"""The CUDA-only part of the hybrid's ordering: a copy stream beside the compute stream, and the
marks (events) that order one against the other and the host against both.

A `Mark` is a point in one stream's queue. The slots record where each one was last read
(a compute mark after the kernel) and last filled (a copy mark after the copy), so that:
- no kernel reads a slot before its bytes land: the compute stream waits for the fill's mark;
- no copy overwrites a slot a queued kernel still reads: the copy stream waits for the read's.
Marks of one stream are ordered (their `seq`), so waiting for the latest of several is waiting
for all of them.

On a CPU device (tests, with torch's CPU device standing in for the GPU) every mark is None and
every wait a no-op: torch runs each CPU op when it is issued, in program order, which is one
valid schedule of the same queue (a copy lands before the kernel issued after it; a kernel
finishes before the copy issued after it).

Events come from a ring, recorded again after RING uses: waiting on an event that was recorded
again waits for a later point of the same stream, which is later than needed but never wrong
(and never a cycle: a wait captures the event's last record, which is always already queued).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

RING = 512  # events per stream; a step records a few per MoE layer


@dataclass(frozen=True)
class Mark:
    seq: int  # increases along the stream
    event: Any  # torch.cuda.Event


def latest(marks: Iterable[Mark | None]) -> Mark | None:
    """The mark of the highest seq among marks of one stream (None: no mark given)."""
    best = None
    for m in marks:
        if m is not None and (best is None or m.seq > best.seq):
            best = m
    return best


class _Ring:
    def __init__(self) -> None:
        self.events = [torch.cuda.Event() for _ in range(RING)]
        self.seq = 0

    def record(self, stream) -> Mark:
        self.seq += 1
        event = self.events[self.seq % RING]
        event.record(stream)
        return Mark(self.seq, event)


class _OnStream:
    """torch.cuda.stream(stream) for a stream of the current device, at a fraction of its host
    time: torch's context looks the device up through several Python layers on entry and exit
    (~40 us a switch on the device host, two switches per staged round)."""

    __slots__ = ("stream", "before")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.before = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.before)


class DeviceStreams:
    """The compute stream (the current one when made), a copy stream, and a repack stream of
    `device` (GGUF blocks rearranged into the kernels' layout after their copy, beside the next
    copy rather than in the copy stream's queue)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.copy = torch.cuda.Stream(device)
            self.repack = torch.cuda.Stream(device)
            self._compute_ring, self._copy_ring, self._repack_ring = _Ring(), _Ring(), _Ring()

    def on_copy_stream(self):
        """Context in which torch ops are queued on the copy stream."""
        return _OnStream(self.copy) if self.cuda else contextlib.nullcontext()

    def on_repack_stream(self):
        """Context in which torch ops are queued on the repack stream."""
        return _OnStream(self.repack) if self.cuda else contextlib.nullcontext()

    def mark_compute(self) -> Mark | None:
        return self._compute_ring.record(self.compute) if self.cuda else None

    def mark_copy(self) -> Mark | None:
        return self._copy_ring.record(self.copy) if self.cuda else None

    def mark_repack(self) -> Mark | None:
        return self._repack_ring.record(self.repack) if self.cuda else None

    def repack_waits(self, mark: Mark | None) -> None:
        """Work queued on the repack stream from now on starts after `mark`."""
        if mark is not None:
            self.repack.wait_event(mark.event)

    def compute_waits(self, mark: Mark | None) -> None:
        """Work queued on the compute stream from now on starts after `mark` (of another
        stream)."""
        if mark is not None:
            self.compute.wait_event(mark.event)

    def copy_waits(self, mark: Mark | None) -> None:
        """Work queued on the copy stream from now on starts after `mark` (of another stream)."""
        if mark is not None:
            self.copy.wait_event(mark.event)

    def host_waits(self) -> None:
        """The host waits for everything queued on the compute stream."""
        if self.cuda:
            self.compute.synchronize()

    def host_tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor for an asynchronous copy to or from the device: pinned
        (torch's caching host allocator keeps a block from reuse until the copies queued on it
        are done), plain memory on a CPU device."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t`, queued on the compute stream; valid after a host wait (or now,
        on a CPU device)."""
        if not self.cuda:
            return t
        out = self.host_tensor(t.shape, t.dtype)
        out.copy_(t, non_blocking=True)
        return out

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a host_tensor) on the device, queued on the current stream."""
        return t.to(self.device, non_blocking=True) if self.cuda else t
