"""Locking host memory for DMA: page ranges registered with the CUDA driver, shared process-wide.

A registered range may not overlap another (the driver refuses: "part or all of the requested
memory range is already mapped"), yet several executors over one mapped GGUF each want its
experts' span locked. `SharedRegistration` keeps the ranges registered so far with a count of
their users: a request registers only the parts of its span no earlier range covers, and a range
is unregistered when its last user lets go. `Pinning` is the seam the homes use (pin / unpin);
`cuda_pinning()` is the process's one SharedRegistration over the driver, `NoPinning` a CPU
device's (nothing is copied by DMA there).

The driver API (libcuda's cuMemHostRegister, through ctypes), not the runtime's
cudaHostRegister: a refused runtime call stays the thread's last runtime error, which torch's
next kernel-launch check raises as that kernel's failure; a driver call leaves the runtime's
error state alone. Ranges are registered PORTABLE (pinned for every context) and, for the mapped
file, READ_ONLY (its pages are never written; the driver needs the flag for a read-only mapping).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


class Pinning(Protocol):
    def pin(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        """Lock [ptr, ptr + nbytes) for DMA; None when done, else why not."""
        ...

    def unpin(self, ptr: int) -> None:
        """Let go of the lock taken by the pin at ptr (one of them, when pinned twice)."""
        ...


class NoPinning:
    """A CPU device: nothing is copied by DMA, so nothing needs locking."""

    def pin(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        return None

    def unpin(self, ptr: int) -> None:
        pass


class Driver(Protocol):
    def register(self, ptr: int, nbytes: int, read_only: bool) -> str | None: ...

    def unregister(self, ptr: int) -> None: ...


@dataclass
class _Range:
    start: int
    end: int
    read_only: bool
    users: int = 0


@dataclass
class SharedRegistration:
    """Registered ranges with their users (module doc), over `driver`; thread-safe.

    A section may be re-entered by its own thread: a cyclic collection that runs inside it (any
    allocation may start one) can finalize a dropped executor, whose close() unpins. With a
    plain lock that thread waited for itself forever (seen on the H100: a test stuck in cuts()
    under an executor's __del__). The lock is re-entrant and an unpin is applied when the
    outermost section ends, never in the middle of another's walk over the ranges."""

    driver: Driver
    _ranges: list[_Range] = field(default_factory=list)  # disjoint, in no particular order
    _pins: dict[int, list[list[_Range]]] = field(default_factory=dict)  # ptr -> each pin's
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _depth: int = 0  # sections of the lock's holder now open
    _unpins: list[int] = field(default_factory=list)  # unpins waiting for the outermost's end

    @contextlib.contextmanager
    def _section(self) -> Iterator[None]:
        """The lock, held; the waiting unpins applied as the outermost section ends (those
        its own unpins' finalizers add included)."""
        with self._lock:
            self._depth += 1
            try:
                yield
                if self._depth == 1:
                    while self._unpins:
                        self._release(self._unpins.pop(0))
            finally:
                self._depth -= 1

    def pin(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        end = ptr + nbytes
        with self._section():
            covering = sorted((r for r in self._ranges if r.start < end and ptr < r.end),
                              key=lambda r: r.start)  # fmt: skip
            if not read_only and any(r.read_only for r in covering):
                return "part of the range is already registered read-only"
            made: list[_Range] = []
            at = ptr
            for r in [*covering, None]:
                gap_end = end if r is None else r.start
                if at < gap_end:
                    why = self.driver.register(at, gap_end - at, read_only)
                    if why is not None:
                        for m in made:
                            self.driver.unregister(m.start)
                        return why
                    made.append(_Range(at, gap_end, read_only))
                if r is not None:
                    at = max(at, r.end)
            self._ranges += made
            used = covering + made
            for r in used:
                r.users += 1
            self._pins.setdefault(ptr, []).append(used)
            return None

    def unpin(self, ptr: int) -> None:
        with self._section():
            self._unpins.append(ptr)  # applied as the outermost section ends

    def _release(self, ptr: int) -> None:
        """unpin's work, inside the outermost section."""
        pins = self._pins.get(ptr)
        if not pins:
            return
        used = pins.pop()
        if not pins:
            del self._pins[ptr]
        for r in used:
            r.users -= 1
            if r.users == 0:
                self._ranges.remove(r)
                self.driver.unregister(r.start)

    def cuts(self, ptr: int, nbytes: int) -> list[int]:
        """The offsets in (0, nbytes) where a registered range starts or ends inside
        [ptr, ptr + nbytes), ascending: a DMA copy from host memory that starts inside a
        registered range and runs past its end is refused ("invalid argument"), so a copy of
        such a span is made in pieces cut there (`dma_cuts`)."""
        with self._section():
            edges = {e - ptr for r in self._ranges for e in (r.start, r.end)}
        return sorted(e for e in edges if 0 < e < nbytes)

    def registered(self) -> list[tuple[int, int]]:
        """The (start, end) of every range registered now, in address order."""
        with self._section():
            return sorted((r.start, r.end) for r in self._ranges)


# ---------------------------------------------------------------------------------------------
# The CUDA driver (a GPU only)

CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_READ_ONLY = 0x01, 0x08
# Mapped into the device's address space too, so kernels can read it in place over PCIe
# (`mapped_tensor`); CU_MEMHOSTALLOC_DEVICEMAP has the same value.
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02


class CudaDriver:
    """cuMemHostRegister / cuMemHostUnregister of libcuda, each run with the device's primary
    context current (pushed when the calling thread has none: a finalizer may run anywhere)."""

    def __init__(self, device_index: int = 0) -> None:
        self._lib = lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                       ctypes.c_uint]  # fmt: skip
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                     ctypes.c_void_p, ctypes.c_uint]  # fmt: skip
        device = ctypes.c_int()
        lib.cuInit(0)
        status = lib.cuDeviceGet(ctypes.byref(device), device_index)
        if status != 0:
            raise OSError(f"cuDeviceGet({device_index}): {self._error(status)}")
        self._device = device.value

    def _error(self, status: int) -> str:
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorString(status, ctypes.byref(text)) != 0 or not text.value:
            return f"CUDA driver error {status}"
        return text.value.decode()

    def _in_context(self, call) -> int:
        current = ctypes.c_void_p()
        if self._lib.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value:
            return call()
        ctx = ctypes.c_void_p()
        status = self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._device)
        if status != 0:
            return status
        self._lib.cuCtxPushCurrent_v2(ctx)
        try:
            return call()
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            self._lib.cuDevicePrimaryCtxRelease_v2(self._device)

    def register(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        flags |= CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0
        status = self._in_context(lambda: self._lib.cuMemHostRegister_v2(ptr, nbytes, flags))
        return None if status == 0 else self._error(status)

    def unregister(self, ptr: int) -> None:
        self._in_context(lambda: self._lib.cuMemHostUnregister(ptr))

    def alloc(self, nbytes: int) -> int | str:
        """Page-locked host memory from the driver (as cudaHostAlloc), PORTABLE: its address,
        or why not."""
        ptr = ctypes.c_void_p()
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP  # as ALLOC_ flags
        status = self._in_context(lambda: self._lib.cuMemHostAlloc(ctypes.byref(ptr), nbytes,
                                                                   flags))  # fmt: skip
        return ptr.value if status == 0 and ptr.value else self._error(status)

    def free(self, ptr: int) -> None:
        self._in_context(lambda: self._lib.cuMemFreeHost(ptr))

    def device_pointer(self, ptr: int) -> int | str:
        """The device's address of mapped page-locked host memory at ptr, or why not."""
        dev = ctypes.c_uint64()
        status = self._in_context(
            lambda: self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), ptr, 0)
        )
        return dev.value if status == 0 else self._error(status)


class _Unavailable:
    """The driver library could not be loaded: every registration is refused, saying why."""

    def __init__(self, why: str) -> None:
        self.why = why

    def register(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        return self.why

    def unregister(self, ptr: int) -> None:
        pass

    def alloc(self, nbytes: int) -> int | str:
        return self.why

    def free(self, ptr: int) -> None:
        pass

    def device_pointer(self, ptr: int) -> int | str:
        return self.why


_shared: SharedRegistration | None = None
_driver: CudaDriver | _Unavailable | None = None
_shared_lock = threading.Lock()


def cuda_driver() -> CudaDriver | _Unavailable:
    """The CUDA driver's host-memory calls (an _Unavailable that refuses each one when the
    driver library cannot be loaded)."""
    global _driver
    with _shared_lock:
        if _driver is None:
            import torch

            try:
                _driver = CudaDriver(torch.cuda.current_device())
            except OSError as exc:
                _driver = _Unavailable(f"the CUDA driver library cannot be loaded: {exc}")
        return _driver


def cuda_pinning() -> SharedRegistration:
    """The process's registrations with the CUDA driver (one set for every executor)."""
    global _shared
    driver = cuda_driver()
    with _shared_lock:
        if _shared is None:
            _shared = SharedRegistration(driver)
        return _shared


def dma_cuts(ptr: int, nbytes: int) -> list[int]:
    """SharedRegistration.cuts of the process's registrations ([] before any was made)."""
    shared = _shared
    return [] if shared is None else shared.cuts(ptr, nbytes)


def page_locked(nbytes: int) -> np.ndarray | None:
    """nbytes of page-locked host memory from the CUDA driver (as cudaHostAlloc) as a uint8
    array, freed with its last reference; None when the driver refuses. Outside torch's caching
    host allocator, so a copy into it captured in a graph involves no allocator bookkeeping; the
    CPU reads what the GPU wrote into it as fast as plain memory (bench/offload.py
    --host-memory: 22 us for 256 KiB on the device host, as torch's pinned memory)."""
    driver = cuda_driver()
    ptr = driver.alloc(nbytes)
    if isinstance(ptr, str):
        return None
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    weakref.finalize(array, _free, driver, ptr)
    return array


def _free(driver, ptr: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone
        driver.free(ptr)


class _Mapped:
    """__cuda_array_interface__ of mapped host memory (what torch.as_tensor wraps)."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (address, False), "version": 3}  # fmt: skip


def mapped_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """A tensor on `device` over the same bytes as `array` (page-locked or registered host
    memory, mapped: a kernel reads and writes it in place over PCIe, ~50 GB/s of reads on the
    device host, bench/read_ceilings.py --zero-copy), keeping `array` alive; None when the
    driver has no device address for it. On a CPU device: the array itself as a tensor."""
    if device.type != "cuda":
        return torch.from_numpy(array)
    address = cuda_driver().device_pointer(array.ctypes.data)
    if isinstance(address, str):
        return None
    view = _Mapped(address, tuple(array.shape), array.dtype.str)
    tensor = torch.as_tensor(view, device=device)
    _keep[id(tensor)] = array
    weakref.finalize(tensor, _keep.pop, id(tensor), None)
    return tensor


_keep: dict[int, np.ndarray] = {}  # the host arrays mapped tensors read, by tensor
