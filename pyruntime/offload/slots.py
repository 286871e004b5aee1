"""The GPU's expert slots: one device tensor that holds `n_slots` routed experts (of any layer)
in the format the expert kernels read, and the copies that fill them.

tensor: [n_slots, n_ff, 3, n_embd] of the float dtype for f32/f16/bf16 experts, or uint8
[n_slots, n_ff, 3, row_bytes] of q8_0r / q4_0r for Q8_0 / Q4_0 experts (kernels.expert_formats;
the same bytes per expert as the GGUF's). An expert map (expert id -> slot, -1 = not here) makes
kernels.dispatch.moe_experts compute a layer's experts from it.

`fill` copies a batch of experts into slots on the copy stream: float experts straight into
their slots; GGUF blocks into a device staging buffer first, repacked there (kernels'
repack_rows: pure byte moves, a few launches per batch) and scattered into their slots. A copy
into a slot waits for the last kernel that read it (`mark_read`), and `wait_ready` makes the
compute stream wait for the copies of the slots a kernel is about to read
(pyruntime.offload.streams). Repacking on the device rather than keeping a repacked host copy
keeps one layout on the host for every home, which the C core reads as well; it costs the
device 2 x the staged bytes of its own bandwidth (~50x PCIe's) and those few launches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pyruntime.kernels.expert_formats import FLOAT_DTYPES, REPACKED, repack_rows, row_bytes
from pyruntime.offload.streams import DeviceStreams, Mark, latest


class ExpertSlots:
    def __init__(self, n_slots: int, n_ff: int, n_embd: int, gguf_format: str,
                 device: torch.device, streams: DeviceStreams,
                 staging_buffer: int = 8) -> None:  # fmt: skip
        """gguf_format: the experts' kernel format name in the GGUF (f32, f16, bf16, q8_0,
        q4_0); staging_buffer: experts per repack batch (block formats only)."""
        self.n_slots = n_slots
        self.gguf_format = gguf_format
        self.format = REPACKED.get(gguf_format, gguf_format)
        self.expert_bytes = n_ff * 3 * row_bytes(gguf_format, n_embd)
        self.streams = streams
        dtype = FLOAT_DTYPES.get(gguf_format, torch.uint8)
        last = n_embd if gguf_format in FLOAT_DTYPES else row_bytes(gguf_format, n_embd)
        self.tensor = torch.empty((n_slots, n_ff, 3, last), dtype=dtype, device=device)
        self._flat = self.tensor.view(torch.uint8).view(n_slots, self.expert_bytes)
        self._shape = (n_ff, 3, last)
        self._buffer = None  # [staging_buffer, expert_bytes] uint8: GGUF blocks to repack
        if gguf_format in REPACKED and n_slots:
            rows = max(1, min(staging_buffer, n_slots))
            self._buffer = torch.empty((rows, self.expert_bytes), dtype=torch.uint8,
                                       device=device)  # fmt: skip
        self._read: list[Mark | None] = [None] * n_slots  # after the last kernel reading it
        self._ready: list[Mark | None] = [None] * n_slots  # after the copy that filled it

    def fill(self, slots: Sequence[int], sources: Sequence[torch.Tensor]) -> None:
        """Copy sources[j] (the GGUF bytes of one expert, a flat uint8 host tensor) into slot
        slots[j], asynchronously on the copy stream."""
        if not slots:
            return
        streams = self.streams
        with streams.on_copy_stream():
            streams.copy_waits(latest(self._read[s] for s in slots))
            if self._buffer is None:
                for s, src in zip(slots, sources, strict=True):
                    self._flat[s].copy_(src, non_blocking=True)
            else:
                step = self._buffer.shape[0]
                for j in range(0, len(slots), step):
                    self._repack_into(slots[j : j + step], sources[j : j + step])
            mark = streams.mark_copy()
        for s in slots:
            self._ready[s] = mark

    def _repack_into(self, slots: Sequence[int], sources: Sequence[torch.Tensor]) -> None:
        """GGUF blocks -> the staging buffer -> repacked into their slots (copy stream)."""
        n = len(slots)
        for row, src in zip(self._buffer, sources, strict=False):
            row.copy_(src, non_blocking=True)
        packed = repack_rows(self._buffer[:n].view(n, *self._shape), self.gguf_format)
        if _consecutive(slots):
            self.tensor[slots[0] : slots[0] + n].copy_(packed)
        else:
            for j, s in enumerate(slots):
                self.tensor[s].copy_(packed[j])

    def wait_ready(self, slots: Iterable[int]) -> None:
        """The compute stream's next kernels start after the copies into `slots` landed."""
        self.streams.compute_waits(latest(self._ready[s] for s in slots))

    def mark_read(self, slots: Iterable[int]) -> None:
        """Record that the kernels queued so far read `slots` (a later fill waits for them)."""
        mark = self.streams.mark_compute()
        for s in slots:
            self._read[s] = mark


def _consecutive(slots: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(slots, slots[1:], strict=False))
