"""A GGUF file as its fields, and files built from those fields: what the mutants are made of.

`map_file` walks a well-formed GGUF (v2/v3) once, on its own (it shares no code with
pyruntime.gguf, the reader the mutants test), and records every field: where it is, how long,
what it holds, and which entry (the head, a key, a tensor info) it belongs to. `build` and
`rebuild` make a file from a map's pieces with the header padding recomputed, so that a mutant
built from them carries only the fault it was made with.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

# GGUF value types (ggml's docs/gguf.md)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip


@dataclass
class Field:
    start: int
    size: int
    kind: str  # "struct" (counts, lengths, types, dims, offsets), "key", "name", "value", "data"
    label: str
    key: str | None = None  # the metadata key a value or key-name field belongs to
    group: str = "head"  # "head", "kv:KEY" or "tensor:NAME": the entry holding the field


@dataclass
class KV:
    key: str
    start: int  # the key's length field
    end: int
    vtype: int
    value_start: int  # where the value (after the type tag) starts


@dataclass
class TensorEntry:
    name: str
    start: int
    end: int
    dims: tuple[int, ...]
    ttype: int
    offset: int
    padded_size: int = 0  # data bytes up to the next tensor's (or the file's end)


@dataclass
class FileMap:
    data: bytes
    version: int
    alignment: int
    kvs: list[KV]
    tensors: list[TensorEntry]
    data_start: int
    fields: list[Field] = field(default_factory=list)

    @property
    def arch(self) -> str:
        kv = next(k for k in self.kvs if k.key == "general.architecture")
        (n,) = struct.unpack_from("<Q", self.data, kv.value_start)
        return self.data[kv.value_start + 8 : kv.value_start + 8 + n].decode()

    def kv_blob(self, kv: KV) -> bytes:
        return self.data[kv.start : kv.end]

    def tensor_blob(self, t: TensorEntry, name: str | None = None, offset: int | None = None):
        name_b = (t.name if name is None else name).encode()
        dims = b"".join(struct.pack("<Q", d) for d in t.dims)
        off = t.offset if offset is None else offset
        return (struct.pack("<Q", len(name_b)) + name_b + struct.pack("<I", len(t.dims)) + dims
                + struct.pack("<IQ", t.ttype, off))  # fmt: skip

    def padded(self, t: TensorEntry) -> bytes:
        """The tensor's data with its padding, as stored."""
        start = self.data_start + t.offset
        return self.data[start : start + t.padded_size]

    def pick(self, rng: random.Random, kinds: tuple[str, ...], groups: str = "hkt") -> Field:
        """A field of one of `kinds`: first an entry (h: the head, k: a key, t: a tensor info),
        uniformly, then one of its fields, so thousands of vocabulary strings do not drown the
        few fields of a hyper-parameter."""
        by_group: dict[str, list[Field]] = {}
        for f in self.fields:
            if f.kind in kinds and f.size and f.group[0] in groups:
                by_group.setdefault(f.group, []).append(f)
        return rng.choice(by_group[rng.choice(sorted(by_group))])


def map_file(data: bytes) -> FileMap:
    """Walk a well-formed GGUF (v2/v3) and record every field."""
    fields: list[Field] = []
    pos = 0
    group = "head"

    def take(fmt: str, kind: str, label: str, key: str | None = None) -> int:
        nonlocal pos
        size = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, data, pos)
        fields.append(Field(pos, size, kind, label, key, group))
        pos += size
        return v

    def string(kind: str, label: str, key: str | None = None) -> str:
        nonlocal pos
        n = take("<Q", "struct", f"{label} length", key)
        fields.append(Field(pos, n, kind, label, key, group))
        pos += n
        return data[pos - n : pos].decode("utf-8", "replace")

    def value(vtype: int, key: str, label: str) -> None:
        nonlocal pos
        if vtype == STRING:
            string("value", label, key)
        elif vtype == ARRAY:
            etype = take("<I", "struct", f"{label} element type", key)
            count = take("<Q", "struct", f"{label} count", key)
            if etype in _SCALAR:
                size = struct.calcsize(_SCALAR[etype]) * count
                fields.append(Field(pos, size, "value", label, key, group))
                pos += size
            else:
                for i in range(count):
                    value(etype, key, f"{label}[{i}]")
        else:
            take(_SCALAR[vtype], "value", label, key)

    take("<I", "struct", "magic")
    version = take("<I", "struct", "version")
    n_tensors = take("<Q", "struct", "tensor count")
    n_kv = take("<Q", "struct", "key count")
    kvs = []
    for i in range(n_kv):
        start = pos
        group = f"kv:{i}"
        key = string("key", "key name")
        vtype = take("<I", "struct", f"{key} type", key)
        value_start = pos
        value(vtype, key, key)
        kvs.append(KV(key, start, pos, vtype, value_start))
    align = 32
    for kv in kvs:
        if kv.key == "general.alignment":
            (align,) = struct.unpack_from("<I", data, kv.value_start)
    tensors = []
    for i in range(n_tensors):
        start = pos
        group = f"tensor:{i}"
        name = string("name", "tensor name")
        n_dims = take("<I", "struct", f"{name} n_dims")
        dims = tuple(take("<Q", "struct", f"{name} dim") for _ in range(n_dims))
        ttype = take("<I", "struct", f"{name} type")
        offset = take("<Q", "struct", f"{name} offset")
        tensors.append(TensorEntry(name, start, pos, dims, ttype, offset))
    data_start = -(-pos // align) * align
    ends = [t.offset for t in tensors[1:]] + [len(data) - data_start]
    for t, end in zip(tensors, ends, strict=True):
        t.padded_size = end - t.offset
    fields.append(Field(data_start, len(data) - data_start, "data", "tensor data", group="data"))
    return FileMap(data, version, align, kvs, tensors, data_start, fields)


# ---------------------------------------------------------------------------------------------
# Building files


def encode_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        b = value.encode()
        return struct.pack("<Q", len(b)) + b
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(
            encode_value(etype, v) for v in items
        )
    return struct.pack(_SCALAR[vtype], value)


def kv_blob(key: str, vtype: int, value) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + encode_value(vtype, value)


def nested_array(depth: int) -> bytes:
    """The value bytes (after an ARRAY type tag) of arrays nested `depth` deep, one item each."""
    inner = struct.pack("<IQB", U8, 1, 0)
    return struct.pack("<IQ", ARRAY, 1) * (depth - 1) + inner


def build(fm: FileMap, kvs: list[bytes], tensors: list[bytes], data: bytes, **counts) -> bytes:
    """A file from its pieces: the header counts (n_kv, n_tensors: the pieces' unless given),
    padding to the alignment, then the data section."""
    n_kv = counts.get("n_kv", len(kvs))
    n_tensors = counts.get("n_tensors", len(tensors))
    head = struct.pack("<IIQQ", 0x46554747, fm.version, n_tensors, n_kv)
    header = head + b"".join(kvs) + b"".join(tensors)
    pad = -len(header) % fm.alignment
    return header + b"\0" * pad + data


def rebuild(fm: FileMap, kvs: list[bytes] | None = None, tensors: list[bytes] | None = None):
    data = fm.data[fm.data_start :]
    return build(
        fm,
        [fm.kv_blob(k) for k in fm.kvs] if kvs is None else kvs,
        [fm.tensor_blob(t) for t in fm.tensors] if tensors is None else tensors,
        data,
    )


def resize_tensor(fm: FileMap, name: str, dims: tuple[int, ...], data: bytes) -> bytes:
    """The file with tensor `name` given new dims and data (offsets after it moved to match): a
    well-formed file whose tensor no longer fits the model."""
    blobs, section, offset = [], b"", 0
    for t in fm.tensors:
        chunk = fm.padded(t)
        if t.name == name:
            t = TensorEntry(t.name, t.start, t.end, dims, t.ttype, t.offset)
            chunk = data + b"\0" * (-len(data) % fm.alignment)
        blobs.append(fm.tensor_blob(t, offset=offset))
        section += chunk
        offset += len(chunk)
    return build(fm, [fm.kv_blob(k) for k in fm.kvs], blobs, section)
