"""The GPU's expert slots: one device tensor that holds `n_slots` routed experts (of any layer)
in the format the expert kernels read, and the copies that fill them.

tensor: [n_slots, n_ff, 3, n_embd] of the float dtype for f32/f16/bf16 experts, or uint8
[n_slots, n_ff, 3, row_bytes] of q8_0r / q4_0r / mxfp4r for Q8_0 / Q4_0 / MXFP4 experts
(kernels.expert_formats; the same bytes per expert as the GGUF's, mxfp4r's rows padded to 16).
An expert map (expert id -> slot, -1 = not here) makes kernels.dispatch.moe_experts compute a
layer's experts from it.

`fill` copies a batch of experts into slots on the copy stream: float experts straight into
their slots; GGUF blocks into a device staging buffer first (a ring of two halves), then
repacked from there straight into their slots on the repack stream (kernels.slot_repack: one
launch, pure byte moves, the slot numbers its scalar arguments), so the next batch's copy runs
while this one is repacked. A batch's copies are one call (torch._foreach_copy_: a copy per
expert queued from C) where the sources are ready; bounce buffers are filled and copied one
expert after the other so the first copy starts before the CPU fills the next. Whatever writes
a slot waits for the last kernel that read it (`mark_read`); a copy into a staging half waits
for the repack that last read it; `wait_ready` makes the compute stream wait for the copy
(float) or repack (blocks) that filled the slots a kernel is about to read
(pyruntime.offload.streams). A staged batch of GGUF blocks queues two calls on the device (its
copies, its repack), two marks and up to three waits.
Repacking on the device rather than keeping a repacked host copy keeps one layout on the host
for every home, which the C core reads as well; it costs the device 2 x the staged bytes of
its own bandwidth (~50x PCIe's) and a launch per batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pyruntime.kernels.expert_formats import FLOAT_DTYPES, REPACKED, row_bytes
from pyruntime.kernels.slot_repack import repack_into_slots
from pyruntime.offload.streams import DeviceStreams, Mark, latest


class ExpertSlots:
    def __init__(self, n_slots: int, n_ff: int, n_embd: int, gguf_format: str,
                 device: torch.device, streams: DeviceStreams,
                 staging_buffer: int = 8) -> None:  # fmt: skip
        """gguf_format: the experts' kernel format name in the GGUF (f32, f16, bf16, q8_0,
        q4_0, mxfp4); staging_buffer: experts per repack batch (block formats only)."""
        self.n_slots, self.n_embd = n_slots, n_embd
        self.gguf_format = gguf_format
        self.format = REPACKED.get(gguf_format, gguf_format)
        self.expert_bytes = n_ff * 3 * row_bytes(gguf_format, n_embd)  # one GGUF expert
        self.streams = streams
        dtype = FLOAT_DTYPES.get(gguf_format, torch.uint8)
        last = n_embd if gguf_format in FLOAT_DTYPES else row_bytes(self.format, n_embd)
        self.tensor = torch.empty((n_slots, n_ff, 3, last), dtype=dtype, device=device)
        # float slots take the GGUF bytes as they are (their bytes == expert_bytes)
        self._flat = self.tensor.view(torch.uint8).view(n_slots, n_ff * 3 * last * dtype.itemsize)
        # GGUF blocks to repack: two halves of staging_buffer experts [rows, expert_bytes] uint8
        # (one when there is room for one expert only), each free again after its repack
        self._ring: list[torch.Tensor] = []
        self._ring_free: list[Mark | None] = []
        self._turn = 0
        if gguf_format in REPACKED and n_slots:
            rows = max(1, min(staging_buffer, n_slots))
            halves = 2 if rows >= 2 else 1
            for _ in range(halves):
                self._ring.append(torch.empty((rows // halves, self.expert_bytes),
                                              dtype=torch.uint8, device=device))  # fmt: skip
                self._ring_free.append(None)
        self._read: list[Mark | None] = [None] * n_slots  # after the last kernel reading it
        self._ready: list[Mark | None] = [None] * n_slots  # after the copy or repack filling it

    def fill(self, slots: Sequence[int], sources: Sequence[torch.Tensor]) -> None:
        """Copy sources[j] (the GGUF bytes of one expert, a flat uint8 host tensor) into slot
        slots[j], asynchronously (module doc)."""
        if not slots:
            return
        streams = self.streams
        if not self._ring:
            with streams.on_copy_stream():
                streams.copy_waits(latest(self._read[s] for s in slots))
                _copy_rows([self._flat[s] for s in slots], sources)
                mark = streams.mark_copy()
            for s in slots:
                self._ready[s] = mark
            return
        step = self._ring[0].shape[0]
        for j in range(0, len(slots), step):
            self._repack_into(slots[j : j + step], sources[j : j + step])

    def _repack_into(self, slots: Sequence[int], sources: Sequence[torch.Tensor]) -> None:
        """GGUF blocks -> a staging half (copy stream) -> repacked into their slots (repack
        stream)."""
        streams, n = self.streams, len(slots)
        half = self._turn
        self._turn = (half + 1) % len(self._ring)
        buf = self._ring[half]
        with streams.on_copy_stream():
            streams.copy_waits(self._ring_free[half])
            _copy_rows(buf[:n].unbind(0), sources)
            copied = streams.mark_copy()
        with streams.on_repack_stream():
            streams.repack_waits(copied)
            streams.repack_waits(latest(self._read[s] for s in slots))
            repack_into_slots(buf, slots, self.tensor, self.gguf_format, self.n_embd)
            mark = streams.mark_repack()
        self._ring_free[half] = mark
        for s in slots:
            self._ready[s] = mark

    def wait_ready(self, slots: Iterable[int]) -> None:
        """The compute stream's next kernels start after the bytes of `slots` landed (their
        marks are all of one stream: the copy stream's, or the repack stream's)."""
        self.streams.compute_waits(self.ready_mark(slots))

    def ready_mark(self, slots: Iterable[int]) -> Mark | None:
        """The point of its stream after which the bytes of `slots` are in place (None on a
        CPU device)."""
        return latest(self._ready[s] for s in slots)

    def mark_read(self, slots: Iterable[int]) -> None:
        """Record that the kernels queued so far read `slots` (a later fill waits for them)."""
        mark = self.streams.mark_compute()
        for s in slots:
            self._read[s] = mark


def _copy_rows(rows: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """rows[j] = sources[j] (host -> device, asynchronous): one call for a list of sources;
    one copy at a time for a lazy sequence (bounce buffers, filled as each is asked for)."""
    if isinstance(sources, list):
        torch._foreach_copy_(list(rows), sources, non_blocking=True)
        return
    for row, src in zip(rows, sources, strict=True):
        row.copy_(src, non_blocking=True)
