"""The GGUF header, parsed and checked against the format's rules before any tensor byte is used.

A GGUF file (ggml's docs/gguf.md; versions 2 and 3, little-endian) is: magic "GGUF", version u32,
tensor count u64, key count u64; the keys (string key, u32 value type, value); the tensor infos
(string name, u32 n_dims, u64 dims innermost first, u32 ggml type, u64 offset); padding to the
alignment; the tensor data. Strings are a u64 byte length and UTF-8 bytes; an array is a u32
element type, a u64 count and the elements.

Every rule is checked here, each failure a `FormatError` naming the key or tensor: the magic and
version; the counts against the file size; every string and array length against the bytes left
and llama.cpp's limits; array nesting depth; value types known and bools 0 or 1; keys and tensor
names non-empty, valid UTF-8, unique; at most 4 dims, no element count or byte size past 2^63;
ggml types known, rows a whole number of blocks; `general.alignment` a u32 power of two; tensor
data in order and contiguous as llama.cpp's gguf.cpp requires (each tensor starts where the
previous one's padded data ends) and the file ending where the last tensor's padded data ends, as
both ggml's and gguf-py's writers write it. Sizes are Python ints, so no check can overflow.
Nothing here knows a model: which keys and tensors a model needs is the model's business.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = 0x46554747  # b"GGUF" read as a little-endian u32
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1: ggml keeps names NUL-terminated in 64 bytes
MAX_KEY_BYTES = 65535  # the spec's key length limit
MAX_STRING_BYTES = 1 << 30  # GGUF_MAX_STRING_LENGTH of llama.cpp's reader
MAX_ARRAY_ITEMS = 1 << 30  # GGUF_MAX_ARRAY_ELEMENTS
# The spec allows arrays of arrays, llama.cpp refuses any, gguf-py reads any depth; no real file
# nests at all. A bound keeps a hostile file from exhausting the stack.
MAX_ARRAY_DEPTH = 4
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, a 1-byte name, n_dims, type, offset

V = GGUFValueType
_SCALAR = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.FLOAT32: "<f", V.BOOL: "<B", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
}  # fmt: skip
_DTYPE = {v: np.dtype(f) for v, f in _SCALAR.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# A value's type signature: (scalar type,) or (ARRAY, element type) or (ARRAY, ARRAY, ...).
Signature = tuple[GGUFValueType, ...]


class FormatError(ValueError):
    """A rule of the GGUF format is broken; the message is one line naming the key or tensor."""


def signature_name(sig: Signature) -> str:
    """UINT32, ARRAY[STRING], ARRAY[ARRAY[INT32]]."""
    return sig[0].name if len(sig) == 1 else f"ARRAY[{signature_name(sig[1:])}]"


class NumericArray(Sequence):
    """A numeric or bool GGUF array, left in the mapping: elements become Python numbers only
    when read, so a hostile count cannot turn a file into 36 bytes of Python int per byte."""

    def __init__(self, data: np.ndarray, is_bool: bool = False) -> None:
        self.data = data  # read-only view of the mapped file
        self._is_bool = is_bool

    def tolist(self) -> list:
        values = self.data.tolist()
        return [bool(v) for v in values] if self._is_bool else values

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return NumericArray(self.data[i], self._is_bool).tolist()
        v = self.data[i].item()
        return bool(v) if self._is_bool else v

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self.tolist() == list(other)

    def __repr__(self) -> str:
        return f"NumericArray({len(self)} x {self.data.dtype})"


class LazyStrings(Sequence):
    """A GGUF string array decoded on first access (the offset of each string kept): the ggml
    vocabulary and merges, which the runtime does not read, cost no decoding."""

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


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's ne: innermost first
    qtype: GGMLQuantizationType
    offset: int  # bytes from the start of the data section
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    signatures: dict[str, Signature]  # each key's stored type
    tensors: list[TensorInfo]  # in file order
    alignment: int
    data_start: int  # file offset of the data section


class _Cursor:
    """Sequential little-endian reads over the mapped file; every read checks its length."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise FormatError(
                f"{what} needs {n} bytes at byte {self.pos}, past the end of the file "
                f"({self.end} bytes): truncated or corrupt"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str, limit: int = MAX_STRING_BYTES) -> tuple[int, int]:
        """(offset, length) of a string, skipped over."""
        n = self.u64(f"{what}'s length")
        if n > limit:
            raise FormatError(f"{what} is {n} bytes long, over the limit of {limit}")
        self.need(n, what)
        start = self.pos
        self.pos += n
        return start, n

    def text(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        start, n = self.raw_string(what, limit)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{what} is not valid UTF-8 (byte {start + exc.start})") from None

    def value_type(self, what: str) -> GGUFValueType:
        t = self.u32(f"{what}'s type")
        try:
            return GGUFValueType(t)
        except ValueError:
            raise FormatError(f"{what} has unknown value type {t}") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> tuple[Any, Signature]:
        if vtype == V.STRING:
            return self.text(what), (vtype,)
        if vtype == V.ARRAY:
            return self.array(what, depth + 1)
        fmt = _SCALAR[vtype]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        if vtype == V.BOOL:
            if v > 1:
                raise FormatError(f"{what} is a bool stored as {v} (a bool is 0 or 1)")
            v = bool(v)
        return v, (vtype,)

    def array(self, what: str, depth: int) -> tuple[Any, Signature]:
        if depth > MAX_ARRAY_DEPTH:
            raise FormatError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.value_type(f"{what}'s element")
        count = self.u64(f"{what}'s count")
        smallest = {V.STRING: 8, V.ARRAY: 12}.get(etype) or _DTYPE[etype].itemsize
        if count > MAX_ARRAY_ITEMS:
            raise FormatError(f"{what} has {count} items, over the limit of {MAX_ARRAY_ITEMS}")
        self.need(count * smallest, f"{what} ({count} {etype.name} items)")
        if etype == V.STRING:
            return self._strings(what, count), (V.ARRAY, V.STRING)
        if etype == V.ARRAY:
            items, inner = [], (V.ARRAY, V.UINT8)  # the signature of an empty array of arrays
            for i in range(count):
                item, sig = self.value(V.ARRAY, f"{what}[{i}]", depth)
                if i and sig != inner:
                    raise FormatError(f"{what} mixes arrays of {signature_name(inner)} and "
                                      f"{signature_name(sig)}")  # fmt: skip
                items.append(item)
                inner = sig
            return items, (V.ARRAY, *inner)
        dt = _DTYPE[etype]
        data = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
        if etype == V.BOOL and count and int(data.max()) > 1:
            raise FormatError(f"{what} holds a bool that is neither 0 nor 1")
        self.pos += dt.itemsize * count
        return NumericArray(data, is_bool=etype == V.BOOL), (V.ARRAY, etype)

    def _strings(self, what: str, count: int) -> LazyStrings:
        offsets, lengths = [], []
        buf, pos, end = self.buf, self.pos, self.end
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > end:
                raise FormatError(f"{what}[{i}] runs past the end of the file (truncated?)")
            (n,) = unpack(buf, pos)
            if n > MAX_STRING_BYTES or n > end - pos - 8:
                raise FormatError(f"{what}[{i}] is {n} bytes long, past the end of the file")
            offsets.append(pos + 8)
            lengths.append(n)
            pos += 8 + n
        self.pos = pos
        return LazyStrings(buf, offsets, lengths)


def parse_header(buf: memoryview) -> Header:
    """Parse and check the header of the GGUF file mapped in `buf` (the whole file)."""
    cur = _Cursor(buf)
    magic = cur.u32("the magic")
    if magic != MAGIC:
        raise FormatError(f"not a GGUF file (magic {magic.to_bytes(4, 'little')!r})")
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise FormatError(f"GGUF version {version:#x}: a big-endian file, which is not supported")
    if version not in VERSIONS:
        raise FormatError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the key count")
    left = cur.end - cur.pos
    if n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES > left:
        raise FormatError(
            f"{n_tensors} tensors and {n_kv} keys cannot fit in the {cur.end} bytes of the file "
            "(truncated or corrupt)"
        )
    metadata: dict[str, Any] = {}
    signatures: dict[str, Signature] = {}
    for i in range(n_kv):
        key = cur.text(f"key #{i}", MAX_KEY_BYTES)
        if not key:
            raise FormatError(f"key #{i} is empty")
        what = f"metadata key {key!r}"
        if key in metadata:
            raise FormatError(f"{what} appears twice")
        metadata[key], signatures[key] = cur.value(cur.value_type(what), what)
    alignment = _alignment(metadata, signatures)
    tensors = _tensor_infos(cur, n_tensors)
    data_start = -(-cur.pos // alignment) * alignment
    if tensors:
        _check_data_section(tensors, alignment, data_start, cur.end)
    elif cur.end > data_start:
        raise FormatError(f"{cur.end - data_start} bytes follow the header of a file without "
                          "tensors")  # fmt: skip
    return Header(version, metadata, signatures, tensors, alignment, data_start)


def _alignment(metadata: dict[str, Any], signatures: dict[str, Signature]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    if signatures["general.alignment"] != (V.UINT32,):
        sig = signature_name(signatures["general.alignment"])
        raise FormatError(f"metadata key 'general.alignment' is stored as {sig}, expected UINT32")
    align = metadata["general.alignment"]
    if align <= 0 or align & (align - 1):
        raise FormatError(f"metadata key 'general.alignment' is {align}, not a power of two")
    return align


def _tensor_infos(cur: _Cursor, n_tensors: int) -> list[TensorInfo]:
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = cur.text(f"tensor #{i}'s name", MAX_KEY_BYTES)
        what = f"tensor {name!r}"
        if not name or len(name.encode()) > MAX_NAME_BYTES:
            raise FormatError(f"tensor #{i}'s name {name!r} is not 1 to {MAX_NAME_BYTES} bytes")
        if name in seen:
            raise FormatError(f"{what} appears twice")
        seen.add(name)
        n_dims = cur.u32(f"{what}'s dimension count")
        if n_dims > MAX_DIMS:
            raise FormatError(f"{what} has {n_dims} dimensions, more than {MAX_DIMS}")
        dims = tuple(cur.u64(f"{what}'s dimensions") for _ in range(n_dims))
        n_elements = 1
        for d in dims:
            n_elements *= d
        if any(d >= 1 << 63 for d in dims) or n_elements >= 1 << 63:
            raise FormatError(f"{what} has dimensions {list(dims)}: too many elements")
        raw_type = cur.u32(f"{what}'s type")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise FormatError(f"{what} has unknown ggml type {raw_type}") from None
        row = dims[0] if dims else 1
        if row % block:
            raise FormatError(
                f"{what} has rows of {row} elements, not a whole number of {qtype.name} "
                f"blocks of {block}"
            )
        n_bytes = n_elements // block * block_bytes
        if n_bytes >= 1 << 63:
            raise FormatError(f"{what} has dimensions {list(dims)}: too many bytes")
        offset = cur.u64(f"{what}'s offset")
        infos.append(TensorInfo(name, dims, qtype, offset, n_elements, n_bytes))
    return infos


def _check_data_section(
    tensors: list[TensorInfo], alignment: int, data_start: int, file_size: int
) -> None:
    """Tensor data in file order, each tensor starting where the previous one's data, padded to
    the alignment, ends; the file ending with the last one's padding (tensors: at least one)."""
    expected = 0
    after = ""
    for t in tensors:
        if t.offset != expected:
            why = "a gap or overlap"
            if t.offset % alignment:
                why = f"not aligned to {alignment} bytes"
            raise FormatError(
                f"tensor {t.name!r} starts at data offset {t.offset}, expected {expected}{after} "
                f"({why}: tensor data must follow in order, each padded to {alignment} bytes)"
            )
        expected += -(-t.n_bytes // alignment) * alignment
        after = f" after {t.name!r} of {t.n_bytes} bytes"
    end = data_start + expected
    if end > file_size:
        raise FormatError(
            f"truncated file: the tensor data ends at byte {end} (tensor {tensors[-1].name!r}) "
            f"but the file has {file_size} bytes"
        )
    if end < file_size:
        raise FormatError(
            f"{file_size - end} bytes follow the end of the tensor data at byte {end} (a wrong "
            "tensor count, or a damaged tensor table)"
        )
