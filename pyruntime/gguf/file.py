"""Open a pyruntime GGUF file: validated metadata and zero-copy tensor views.

The file is mapped with `np.memmap`, so opening a multi-GB model is instant and costs no resident
memory until a tensor's pages are touched. The header is parsed here rather than with
`gguf.GGUFReader`, which builds a numpy view per vocabulary string (seconds for a 150k-token
vocabulary): numeric arrays are read in bulk and string arrays (the ggml vocabulary and merges,
which the runtime does not need: it tokenizes with the stored tokenizer.json) are decoded only
when accessed. Tensor views follow GGUFReader's conventions (see TensorView).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pyruntime.errors import ModelFileError

LAYOUT_VERSION = 1
_MISSING = object()
_DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (scalars) / numpy dtype (arrays)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


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


class LazyStrings(Sequence):
    """A GGUF string array decoded on first access (offsets of each string kept)."""

    def __init__(self, buf: memoryview, offsets: list[int], lengths: list[int]) -> None:
        self._buf, self._offsets, self._lengths = buf, offsets, lengths
        self._items: list[str] | None = None

    def _all(self) -> list[str]:
        if self._items is None:
            b = self._buf
            self._items = [
                bytes(b[o : o + n]).decode("utf-8", "replace")
                for o, n in zip(self._offsets, self._lengths, strict=True)
            ]
        return self._items

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i):  # type: ignore[override]
        return self._all()[i]

    def __eq__(self, other: object) -> bool:
        return list(self._all()) == list(other) if isinstance(other, Sequence) else False


class _Cursor:
    """Sequential little-endian reader over the mapped header; bounds errors become ValueError."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"header ends early at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"string of {n} bytes runs past the end at byte {self.pos}")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALAR:
            raise ValueError(f"unknown value type {vtype} at byte {self.pos}")
        v = self.take(_SCALAR[vtype])
        return bool(v) if vtype == 7 else v

    def array(self) -> Any:
        etype, count = self.take("<I"), self.take("<Q")
        if etype == _STRING:
            offsets, lengths = [], []
            buf, pos, end = self.buf, self.pos, len(self.buf)
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                if pos + 8 > end:
                    raise ValueError("string array runs past the end of the file")
                (n,) = unpack(buf, pos)
                offsets.append(pos + 8)
                lengths.append(n)
                pos += 8 + n
            if pos > end:
                raise ValueError("string array runs past the end of the file")
            self.pos = pos
            return LazyStrings(buf, offsets, lengths)
        if etype in _DTYPE:
            dt = np.dtype(_DTYPE[etype])
            nbytes = dt.itemsize * count
            if self.pos + nbytes > len(self.buf):
                raise ValueError("array runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += nbytes
            return [bool(v) for v in arr] if etype == 7 else arr.tolist()
        return [self.value(etype) for _ in range(count)]  # arrays of arrays (rare)


class GGUFFile:
    """A validated, memory-mapped GGUF file written by our converter."""

    def __init__(self, path: Path) -> None:
        self._fd: int | None = None  # opened on the first advise_willneed
        self.path = path
        self.file_size = path.stat().st_size
        self._map = np.memmap(path, mode="r")
        cur = _Cursor(memoryview(self._map))
        if cur.take("<I") != 0x46554747:  # b"GGUF"
            raise ValueError("bad magic")
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"bad general.alignment {align}")
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorView] = {}
        for name, dims, qtype, offset in infos:
            self.tensors[name] = self._view(name, dims, qtype, data_start + offset)
        self.arch: str = self.get("general.architecture")

    def _view(self, name: str, dims: list[int], qtype: int, start: int) -> TensorView:
        try:
            qt = GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelFileError(f"{self.path}: tensor '{name}' has unknown type {qtype}") from None
        shape = tuple(int(d) for d in reversed(dims))
        n = int(np.prod(shape)) if shape else 1
        block, block_bytes = GGML_QUANT_SIZES[qt]
        if shape and shape[-1] % block:
            raise ModelFileError(
                f"{self.path}: tensor '{name}' rows of {shape[-1]} do not fit {qt.name} blocks"
            )
        n_bytes = n // block * block_bytes
        if start + n_bytes > self.file_size:
            raise ModelFileError(
                f"{self.path}: truncated GGUF file: tensor '{name}' ends at byte "
                f"{start + n_bytes} but the file has {self.file_size} bytes"
            )
        raw = self._map[start : start + n_bytes]
        if qt == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qt == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:  # quantized and BF16: bytes per row
            data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        return TensorView(name, qt, shape, data, n, n_bytes)

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


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate `path`; every failure is a one-line ModelFileError."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(
            f"{path}: is a directory; convert a Hugging Face folder first with "
            f"`python convert_hf_to_gguf.py {path}`"
        )
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        f = GGUFFile(path)
    except (ValueError, KeyError, OverflowError, UnicodeDecodeError, struct.error) as exc:
        raise ModelFileError(f"{path}: corrupt or truncated GGUF file ({exc})") from None
    version = f.get("pyruntime.layout_version", None)
    if version != LAYOUT_VERSION:
        raise ModelFileError(
            f"{path}: GGUF layout version {version} is not supported (this pyruntime reads "
            f"version {LAYOUT_VERSION}); convert the model again with convert_hf_to_gguf.py"
        )
    return f
