"""Open a GGUF file: checked metadata and zero-copy tensor views.

The file is mapped with `np.memmap`, so opening a multi-GB model is instant and costs no resident
memory until a tensor's pages are touched (or, with in_ram: option `weights_copy`, read into
anonymous memory on 2 MiB pages, read_in_huge_pages). The header is parsed and checked by header.py
rather than by `gguf.GGUFReader`, which builds a numpy view per vocabulary string (seconds for a
150k-token vocabulary) and trusts the file: numeric arrays stay views of the mapping and string
arrays (the ggml vocabulary and merges, which the runtime does not need: it tokenizes with the
stored tokenizer.json) are decoded only when accessed. Tensor views follow GGUFReader's conventions
(see TensorView).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pyruntime.errors import ModelFileError
from pyruntime.gguf.header import (
    FormatError,
    LazyStrings,
    NumericArray,
    Signature,
    TensorInfo,
    parse_header,
)
from pyruntime.gguf.keys import STANDARD_KEYS, check_key_types

__all__ = ["GGUFFile", "LazyStrings", "NumericArray", "TensorView", "open_gguf"]

_MISSING = object()


@dataclass(frozen=True)
class TensorView:
    """One tensor of the file, as stored.

    `shape` is row-major (outermost first, numpy order), i.e. GGUF's `ne` reversed.
    `data` is the raw memmap view: typed (float32 / float16) with `shape` for F32/F16; uint8 of
    shape [*shape[:-1], row_bytes] for block-quantized formats and BF16 (numpy has no bfloat16).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    n_elements: int
    n_bytes: int


class GGUFFile:
    """A memory-mapped GGUF file whose header passed every rule of the format (header.py) and
    whose standard keys have their standard types (keys.py)."""

    def __init__(self, path: Path, in_ram: bool = False) -> None:
        self._fd: int | None = None  # opened on the first advise_willneed
        self.path = path
        self.file_size = path.stat().st_size
        size = self.file_size
        self._map = read_in_huge_pages(path, size) if in_ram else np.memmap(path, mode="r")
        header = parse_header(memoryview(self._map))
        self.version = header.version
        self.alignment = header.alignment
        self.data_start = header.data_start  # file offset of the tensor data (the header's size)
        self.metadata: dict[str, Any] = header.metadata
        self.signatures: dict[str, Signature] = header.signatures  # each key's stored type
        arch = self.metadata.get("general.architecture")
        if arch is None:
            raise FormatError("metadata key 'general.architecture' is missing (the format's one "
                              "required key)")  # fmt: skip
        check_key_types(self.signatures, STANDARD_KEYS, arch)
        self.arch: str = arch
        self.tensors: dict[str, TensorView] = {
            t.name: self._view(t, header.data_start + t.offset) for t in header.tensors
        }

    def _view(self, t: TensorInfo, start: int) -> TensorView:
        """The tensor's bytes in the mapping, typed (header.py has checked its size and bounds)."""
        shape = tuple(reversed(t.dims))  # row-major, outermost first
        raw = self._map[start : start + t.n_bytes]
        if t.qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif t.qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:  # quantized and BF16: bytes per row
            block, block_bytes = GGML_QUANT_SIZES[t.qtype]
            rows = shape or (1,)
            data = raw.reshape(*rows[:-1], rows[-1] // block * block_bytes)
        return TensorView(t.name, t.qtype, shape, data, t.n_elements, t.n_bytes)

    def header_sha256(self) -> str:
        """SHA-256 of the header (metadata and tensor table, up to the tensor data), hex."""
        return hashlib.sha256(memoryview(self._map)[: self.data_start]).hexdigest()

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value as a Python object; ModelFileError if missing and no default."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ModelFileError(f"{self.path}: metadata key '{key}' is missing")
        return default

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        return self.get(f"{self.arch}.{suffix}", default)

    def tensor(self, name: str) -> TensorView:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(
                f"{self.path}: tensor '{name}' is missing (was the file written by "
                "convert_hf_to_gguf.py of this version?)"
            ) from None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def advise_willneed(self, view: np.ndarray) -> None:
        """Ask the OS to start reading `view` (a view of this file's mapping) into the page
        cache now, without waiting: a prefetch of bytes about to be read. No-op where the OS
        has no such call."""
        start = view.ctypes.data - self._map.ctypes.data
        if not 0 <= start <= self.file_size - view.nbytes:
            raise ValueError(f"{self.path}: the array is not a view of this file's mapping")
        if hasattr(os, "posix_fadvise"):
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            os.posix_fadvise(self._fd, start, view.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


def huge_page_array(size: int) -> np.ndarray:
    """uint8 [size], writable, zeroed: a private anonymous mapping from a 2 MiB boundary with
    transparent huge pages asked for (THP on `madvise`; refused: 4 KiB pages)."""
    huge = 2 << 20
    buf = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(buf, dtype=np.uint8)
    skip = -base.ctypes.data % huge
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice, skip, size)
        except OSError:
            pass  # refused: 4 KiB pages, as a mapping of the file
    return base[skip : skip + size]


def read_in_huge_pages(path: Path, size: int) -> np.ndarray:
    """uint8 [size], read-only: the file's bytes in huge_page_array memory. Why: a decode step
    streams the weights while its kernels compute, and on 4 KiB pages (a file mapping's) the
    two hardly overlap: the step is about the read time plus the kernels' in-cache time; on
    2 MiB pages a Q4_K dot streams at 0.9-0.95x the plain read rate, 1.1-1.3x its rate on 4 KiB
    pages (granite-1b-a400m decode, 1 thread, 2-core box: 1.09-1.17x, docs/benchmarks.md).
    Costs RSS: the whole file, on top of the page cache's copy."""
    out = huge_page_array(size)
    with open(path, "rb") as fh:
        done = 0
        while done < size:
            n = fh.readinto(memoryview(out[done:]))
            if not n:
                raise OSError(f"short read at byte {done} of {size}")
            done += n
    out.flags.writeable = False
    return out


def open_gguf(path: str | Path, in_ram: bool = False) -> GGUFFile:
    """Open `path` and check its header; every failure is a one-line ModelFileError naming the
    file and the key or tensor at fault. Any GGUF file passes (ours or llama.cpp's): what a model
    needs of it is checked where the model is built (pyruntime.model). in_ram: the file's bytes
    read into anonymous memory on huge pages (read_in_huge_pages), not mapped."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(
            f"{path}: is a directory; convert a Hugging Face folder first with "
            f"`python convert_hf_to_gguf.py {path}`"
        )
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if not magic:
            raise ModelFileError(f"{path}: an empty file, not a GGUF file")
        if magic != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (bad magic {magic!r})")
        return GGUFFile(path, in_ram)
    except FormatError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
