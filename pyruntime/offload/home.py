"""Where the routed experts live on the host, and how their bytes start toward the GPU.

Three homes behind one interface (`ExpertHome`), chosen by `--staging` (`--pin-experts`):
- register: the experts stay in the mapped GGUF; the span of the mapping that holds them is
  registered read-only with the CUDA driver (pyruntime.offload.host_register: one registration
  per range, shared by every executor over the same mapping), so the copy engine reads them by
  DMA straight from the page cache. Locks those pages in RAM.
- bounce: the experts stay in the mapped GGUF; a staged batch is copied by the CPU into a pinned
  buffer (torch's caching host allocator, which keeps a buffer from reuse until the copies queued
  on it are done: a ring of bounce buffers) expert by expert as the slots ask for them, so the
  DMA of one overlaps the CPU's copy of the next. Costs a CPU copy (DRAM read + write) per staged
  byte, locks nothing beyond the buffers.
- pinned: a copy of every routed expert in anonymous RAM, registered with the driver: the fastest
  DMA source; costs RAM the size of the experts and one read of them at load.
Every home keeps the GGUF layout, so the C core computes from it too (`cpu_view`); q8_0/q4_0 are
repacked on the device after the copy (pyruntime.offload.slots).

Pinning refused (memlock limits, a driver without read-only registration, no RAM): a warning,
and the bounce home instead (which itself falls back to pageable buffers, slower, with a warning
when even those cannot be pinned); never a crash.
`Pinning` is the seam: the shared CUDA registrations on a GPU, NoPinning on a CPU device
(nothing to lock; the tests give a refusing one).
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from pyruntime.errors import PyruntimeWarning
from pyruntime.model.weights import HostWeights
from pyruntime.offload.host_register import NoPinning, Pinning, cuda_pinning, mapped_tensor
from pyruntime.offload.plan import gib

PAGE = mmap.PAGESIZE
Key = tuple[int, int]  # (layer, expert)


def default_pinning(device: torch.device) -> Pinning:
    return cuda_pinning() if device.type == "cuda" else NoPinning()


def _as_tensor(view: np.ndarray) -> torch.Tensor:
    """A flat uint8 torch view of host bytes (no copy; the mapping is never written through)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only arrays
        return torch.from_numpy(view.reshape(-1).view(np.uint8))


class ExpertHome:
    """The routed experts of every MoE layer on the host (module doc)."""

    mode = ""
    in_place = False  # a GPU kernel can read its memory in place (registered, mapped)

    def __init__(self, host: HostWeights) -> None:
        self.layers = {i: blk.experts for i, blk in enumerate(host.blocks) if blk.experts}
        first = next(iter(self.layers.values()), None)
        self.expert_bytes = 0 if first is None else first.expert_bytes
        self._views: dict[int, torch.Tensor] = {}

    def cpu_view(self, layer: int) -> np.ndarray:
        """Layer `layer`'s expert tensor as the C core reads it: [n_expert, n_ff, 3, row]."""
        return self.layers[layer].raw

    def experts(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s experts as uint8 host tensor rows [n_expert, expert_bytes] (a view of
        cpu_view, made once: a staged expert is then one index)."""
        view = self._views.get(layer)
        if view is None:
            view = self._views[layer] = _as_tensor(self.cpu_view(layer)).view(-1, self.expert_bytes)
        return view

    def device_view(self, layer: int, device: torch.device) -> torch.Tensor | None:
        """Layer `layer`'s experts as the kernels take them ([n_expert, n_ff, 3, row] uint8 for
        block formats, f32 / f16 for those floats) on `device`, over the host bytes themselves:
        a kernel reads them in place over PCIe (pyruntime.offload.step_graph's direct
        experts). None where this home's memory is not mapped for the device, or for bf16 (no
        numpy type)."""
        raw = self.cpu_view(layer)
        if raw.dtype not in (np.uint8, np.float32, np.float16):
            return None
        if device.type != "cuda":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only arrays
                return torch.from_numpy(raw)
        return mapped_tensor(raw, device) if self.in_place else None

    def sources(self, keys: Sequence[Key]) -> list[torch.Tensor]:
        """For each (layer, expert), its bytes as a flat uint8 host tensor that a copy to the
        device queued now may read (pinned, registered or plain)."""
        return [self.experts(layer)[e] for layer, e in keys]

    def close(self) -> None:
        """Unlock what this home locked (idempotent)."""


class MappedHome(ExpertHome):
    """register: the mapped file's span that holds the experts, registered read-only."""

    mode = "register"
    in_place = True

    def __init__(self, host: HostWeights, pinning: Pinning) -> None:
        super().__init__(host)
        self._pinning, self._ptr = pinning, None
        raws = [s.raw for s in self.layers.values()]
        start = min(r.ctypes.data for r in raws) // PAGE * PAGE
        end = -(-max(r.ctypes.data + r.nbytes for r in raws) // PAGE) * PAGE
        why = pinning.pin(start, end - start, read_only=True)
        if why is not None:
            raise PinRefused(f"registering the experts' {gib(end - start)} of the mapped file "
                             f"for DMA was refused ({why})")  # fmt: skip
        self._ptr, self.locked_bytes = start, end - start

    def close(self) -> None:
        if self._ptr is not None:
            self._pinning.unpin(self._ptr)
            self._ptr = None


def page_aligned(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array of nbytes starting on a page boundary, alone in its pages
    (registration locks whole pages: no other allocation may share one), freed with its last
    reference."""
    pages = -(-nbytes // PAGE) * PAGE
    raw = np.empty(pages + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + pages][:nbytes]


def page_span(a: np.ndarray) -> int:
    """Bytes of the whole pages `a` (from page_aligned) starts in."""
    return -(-a.nbytes // PAGE) * PAGE


class PinnedHome(ExpertHome):
    """pinned: every routed expert copied into RAM, registered for DMA."""

    mode = "pinned"
    in_place = True

    def __init__(self, host: HostWeights, pinning: Pinning) -> None:
        super().__init__(host)
        self._pinning = pinning
        self._pinned: list[int] = []
        self._copies: dict[int, np.ndarray] = {}
        self.locked_bytes = 0
        total = gib(sum(s.raw.nbytes for s in self.layers.values()))
        try:
            for layer, store in self.layers.items():
                copy = page_aligned(store.raw.nbytes)
                copy[:] = store.raw_bytes()
                why = pinning.pin(copy.ctypes.data, page_span(copy), read_only=False)
                if why is not None:
                    raise PinRefused(f"pinning a {total} copy of the experts in RAM was refused "
                                     f"({why})")  # fmt: skip
                self._pinned.append(copy.ctypes.data)
                self.locked_bytes += copy.nbytes
                self._copies[layer] = copy.view(store.raw.dtype).reshape(store.raw.shape)
        except MemoryError:
            self.close()
            raise PinRefused(f"no RAM for a {total} copy of the experts") from None
        except PinRefused:
            self.close()
            raise

    def cpu_view(self, layer: int) -> np.ndarray:
        return self._copies[layer]

    def close(self) -> None:
        for ptr in self._pinned:
            self._pinning.unpin(ptr)
        self._pinned.clear()
        self._copies.clear()
        self._views.clear()


class BounceHome(ExpertHome):
    """bounce: the CPU copies a staged batch into a pinned buffer, the DMA reads that."""

    mode = "bounce"

    def __init__(self, host: HostWeights, device: torch.device) -> None:
        super().__init__(host)
        self._pinned = device.type == "cuda"
        if self._pinned:
            try:
                torch.empty(self.expert_bytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                warnings.warn(
                    f"cannot pin bounce buffers ({str(exc).splitlines()[0]}): staging experts "
                    "from pageable memory (slower)",
                    PyruntimeWarning,
                    stacklevel=2,
                )
                self._pinned = False

    def sources(self, keys: Sequence[Key]) -> Sequence[torch.Tensor]:
        if not keys:
            return []
        buf = torch.empty((len(keys), self.expert_bytes), dtype=torch.uint8,
                          pin_memory=self._pinned)  # fmt: skip
        views = [self.experts(layer)[e] for layer, e in keys]
        return _BounceBatch(buf, views, [False] * len(keys), range(len(keys)))


class _BounceBatch(Sequence):
    """Bounce buffer rows filled from their experts' bytes when first asked for (a slice is a
    lazy view too), so the copy of one expert to the device is queued before the CPU copies the
    next one."""

    def __init__(self, buf: torch.Tensor, views: list[torch.Tensor], done: list[bool],
                 rows: range) -> None:  # fmt: skip
        self._buf, self._views, self._done, self._rows = buf, views, done, rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return _BounceBatch(self._buf, self._views, self._done, self._rows[j])
        row = self._rows[j]
        if not self._done[row]:
            self._buf[row].copy_(self._views[row])
            self._done[row] = True
        return self._buf[row]


class PinRefused(Exception):
    """A home could not lock its memory for DMA (the message says what and why)."""


STAGING_MODES = ("register", "bounce", "pinned")


def open_home(host: HostWeights, device: torch.device, staging: str,
              pinning: Pinning | None = None) -> ExpertHome:  # fmt: skip
    """The home for `staging` (register, bounce or pinned); a refused pin warns and falls back
    to bounce."""
    if staging not in STAGING_MODES:
        raise ValueError(f"unknown staging {staging!r} (use {', '.join(STAGING_MODES)})")
    pinning = pinning or default_pinning(device)
    try:
        if staging == "register":
            return MappedHome(host, pinning)
        if staging == "pinned":
            return PinnedHome(host, pinning)
    except PinRefused as exc:
        warnings.warn(f"{exc}: staging experts through pinned bounce buffers instead",
                      PyruntimeWarning, stacklevel=2)  # fmt: skip
    return BounceHome(host, device)
