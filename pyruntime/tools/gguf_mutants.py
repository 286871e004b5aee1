"""Mutants of a GGUF file: the corruptions a damaged or hostile file can carry, seeded.

The file is taken apart by gguf_map.py (every field of a well-formed GGUF, and builders that
put the pieces back together). `mutant(fm, seed, i)` makes mutant i of one class, chosen by a
random stream seeded with (seed, i), so any mutant can be remade alone. Classes (CLASSES): bit
flips in the header's structure, in metadata values and in tensor data; truncations; oversized
counts, lengths, dims and offsets; wrong tensor types; wrong value types and wrong values of known
keys (a float stored as an int, "true" as a string, a negative or string block_count, head_count
0); duplicate keys and tensor names; a required tensor dropped; counts off by a few; moved
offsets; nested arrays; version and magic changes.

Each mutant says what a loader must do with it (`expect`):
- "refuse": a structural fault: the file breaks a rule of the format or of the model layout.
- "any": a well-formed file whose values or tensor data changed (a flipped bit in a weight, in the
  model's name, in an optional key): it may run or be refused, never crash or hang.
- "load": the original file.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

from pyruntime.tools.gguf_map import (
    ARRAY,
    F32,
    F64,
    I32,
    STRING,
    U8,
    U32,
    U64,
    Field,
    FileMap,
    build,
    kv_blob,
    nested_array,
    rebuild,
)

# Keys whose value fixes a tensor's shape or the set of tensors (or the layout): any other value
# contradicts the tensors, so a changed value is a structural fault.
SHAPE_KEYS = ("block_count", "embedding_length", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "attention.value_length",
              "expert_count", "expert_feed_forward_length", "vocab_size")  # fmt: skip
HUGE = (2**63 - 1, 2**64 - 1, 2**32, 2**31, 2**40)


# ---------------------------------------------------------------------------------------------
# Mutation classes: each returns (file bytes, label, expect)


def _patch(fm: FileMap, at: int, raw: bytes) -> bytes:
    return fm.data[:at] + raw + fm.data[at + len(raw) :]


def _flip(fm: FileMap, f: Field, rng: random.Random) -> tuple[bytes, int, int]:
    at = f.start + rng.randrange(f.size)
    bit = rng.randrange(8)
    return _patch(fm, at, bytes([fm.data[at] ^ (1 << bit)])), at, bit


def header_bitflip(fm: FileMap, rng: random.Random):
    f = fm.pick(rng, ("struct", "name"))
    out, at, bit = _flip(fm, f, rng)
    expect = "refuse"
    if f.label == "version":
        (v,) = struct.unpack_from("<I", out, 4)
        expect = "any" if v in (2, 3) else "refuse"
    return out, f"bit {bit} of byte {at} ({f.label})", expect


def value_bitflip(fm: FileMap, rng: random.Random):
    f = fm.pick(rng, ("value", "key"), groups="k")
    out, at, bit = _flip(fm, f, rng)
    arch = fm.arch
    shape = f.kind == "value" and f.key in (
        *(f"{arch}.{k}" for k in SHAPE_KEYS),
        "pyruntime.layout_version",
    )
    return out, f"bit {bit} of byte {at} ({f.kind} {f.label})", "refuse" if shape else "any"


def data_bitflip(fm: FileMap, rng: random.Random):
    f = next(f for f in fm.fields if f.kind == "data")
    out, at, bit = _flip(fm, f, rng)
    return out, f"bit {bit} of data byte {at - fm.data_start}", "any"


def truncate(fm: FileMap, rng: random.Random):
    cut = rng.randrange(len(fm.data))
    return fm.data[:cut], f"cut at byte {cut} of {len(fm.data)}", "refuse"


def oversize(fm: FileMap, rng: random.Random):
    f = fm.pick(rng, ("struct",))
    while f.size != 8:  # the u64 fields: counts, lengths, dims, offsets
        f = fm.pick(rng, ("struct",))
    (orig,) = struct.unpack_from("<Q", fm.data, f.start)
    choices = [*HUGE, len(fm.data), len(fm.data) + 1, orig * 2 + 1, orig + 1]
    new = rng.choice([v for v in choices if v != orig and v < 2**64])
    return _patch(fm, f.start, struct.pack("<Q", new)), f"{f.label} {orig} -> {new}", "refuse"


def tensor_type(fm: FileMap, rng: random.Random):
    t = rng.choice(fm.tensors)
    known = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 20, 24, 25, 26, 27, 28, 30, 39]
    new = rng.choice([v for v in [*known, 4, 5, 42, 2**31] if v != t.ttype])
    at = t.end - 12
    return _patch(fm, at, struct.pack("<I", new)), f"{t.name} type {t.ttype} -> {new}", "refuse"


def value_type(fm: FileMap, rng: random.Random):
    kv = rng.choice(fm.kvs)
    at = kv.value_start - 4
    orig = kv.vtype
    if orig == ARRAY and rng.random() < 0.5:  # the element type instead
        at, (orig,) = kv.value_start, struct.unpack_from("<I", fm.data, kv.value_start)
    new = rng.choice([v for v in [*range(13), 13, 99, 2**31] if v != orig])
    label = f"{kv.key} type {orig} -> {new}"
    return _patch(fm, at, struct.pack("<I", new)), label, "refuse"


def _wrong_values(fm: FileMap) -> list[tuple[str, int, object]]:
    a = fm.arch
    return [
        (f"{a}.attention.layer_norm_rms_epsilon", U32, 1),  # a float stored as an int
        (f"{a}.attention.layer_norm_rms_epsilon", F32, float("nan")),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, -1.0),
        (f"{a}.attention.layer_norm_rms_epsilon", F64, 1e-5),
        (f"{a}.rope.freq_base", F32, 0.0),
        (f"{a}.rope.freq_base", F32, float("inf")),
        (f"{a}.expert_weights_norm", STRING, "true"),  # "true" as a string
        (f"{a}.expert_weights_norm", U8, 1),
        (f"{a}.block_count", STRING, "4"),
        (f"{a}.block_count", I32, -2),
        (f"{a}.block_count", U32, 0),
        (f"{a}.block_count", U32, 2),
        (f"{a}.block_count", U64, 4),
        (f"{a}.block_count", U32, 2**32 - 1),
        (f"{a}.attention.head_count", U32, 0),
        (f"{a}.attention.head_count", ARRAY, (I32, [4, 4])),
        (f"{a}.attention.head_count_kv", U32, 0),
        (f"{a}.attention.head_count_kv", U32, 3),
        (f"{a}.attention.key_length", U32, 0),
        (f"{a}.expert_count", U32, 0),
        (f"{a}.expert_used_count", U32, 0),
        (f"{a}.expert_used_count", U32, 10**6),
        (f"{a}.embedding_length", U32, 2**31),
        (f"{a}.context_length", U32, 0),
        (f"{a}.rope.dimension_count", U32, 3),
        (f"{a}.rope.dimension_count", U32, 10**6),
        ("general.alignment", U32, 3),
        ("general.alignment", U32, 0),
        ("general.alignment", U64, 32),
        # a power of two the data is not laid out for (64 may fit it: the header's length decides)
        ("general.alignment", U32, 1 << 20),
        ("general.architecture", STRING, "llama4"),
        ("general.architecture", U32, 1),
        ("pyruntime.layout_version", U32, 2),
        ("pyruntime.layout_version", STRING, "1"),
        ("pyruntime.expert_activation", STRING, "relu"),
        ("tokenizer.ggml.eos_token_id", U32, 2**31),
        ("tokenizer.ggml.bos_token_id", U32, 10**6),
        ("tokenizer.ggml.add_bos_token", U8, 1),
        ("pyruntime.stop_token_ids", ARRAY, (I32, [-1])),
        ("pyruntime.stop_token_ids", ARRAY, (STRING, ["0"])),
        ("tokenizer.huggingface.json", STRING, "{}"),
        ("tokenizer.ggml.tokens", ARRAY, (I32, [1, 2])),
    ]


def wrong_value(fm: FileMap, rng: random.Random):
    key, vtype, value = rng.choice(_wrong_values(fm))
    blob = kv_blob(key, vtype, value)
    kvs = [blob if k.key == key else fm.kv_blob(k) for k in fm.kvs]
    if all(k.key != key for k in fm.kvs):
        kvs.append(blob)
    return rebuild(fm, kvs=kvs), f"{key} = {value!r} stored as type {vtype}", "refuse"


def duplicate_key(fm: FileMap, rng: random.Random):
    kv = rng.choice(fm.kvs)
    blob = fm.kv_blob(kv)
    if kv.vtype == U32 and rng.random() < 0.5:  # a second value: the last one must not win
        (v,) = struct.unpack_from("<I", fm.data, kv.value_start)
        blob = kv_blob(kv.key, U32, max(v // 2, 1))
    kvs = [fm.kv_blob(k) for k in fm.kvs]
    kvs.insert(rng.randrange(len(kvs) + 1), blob)
    return rebuild(fm, kvs=kvs), f"{kv.key} twice", "refuse"


def duplicate_tensor(fm: FileMap, rng: random.Random):
    a, b = rng.sample(fm.tensors, 2)
    tensors = [fm.tensor_blob(t, name=b.name if t is a else None) for t in fm.tensors]
    return rebuild(fm, tensors=tensors), f"{a.name} renamed {b.name}", "refuse"


def drop_tensor(fm: FileMap, rng: random.Random):
    # output.weight may be absent (the output is tied to token_embd): dropping it is a valid file
    drop = rng.choice([t for t in fm.tensors if t.name != "output.weight"])
    kept = [t for t in fm.tensors if t is not drop]
    blobs, data, offset = [], b"", 0
    for t in kept:
        blobs.append(fm.tensor_blob(t, offset=offset))
        chunk = fm.padded(t)
        data += chunk
        offset += len(chunk)
    return build(fm, [fm.kv_blob(k) for k in fm.kvs], blobs, data), f"{drop.name} dropped", "refuse"


def count(fm: FileMap, rng: random.Random):
    which, at = rng.choice([("tensor count", 8), ("key count", 16)])
    (orig,) = struct.unpack_from("<Q", fm.data, at)
    new = max(0, orig + rng.choice([-3, -2, -1, 1, 2, 3]))
    return _patch(fm, at, struct.pack("<Q", new)), f"{which} {orig} -> {new}", "refuse"


def move_offset(fm: FileMap, rng: random.Random):
    t = rng.choice(fm.tensors)
    a = fm.alignment
    choices = [t.offset + d for d in (1, -1, a, -a, 2 * a, a // 2, -t.offset)]
    new = rng.choice([v for v in choices if v >= 0 and v != t.offset])
    at = t.end - 8
    return _patch(fm, at, struct.pack("<Q", new)), f"{t.name} offset {t.offset} -> {new}", "refuse"


def nested(fm: FileMap, rng: random.Random):
    kv = rng.choice(fm.kvs)
    depth = rng.choice([2, 3, 5, 64, 1000, 100000])
    k = kv.key.encode()
    blob = struct.pack("<Q", len(k)) + k + struct.pack("<I", ARRAY) + nested_array(depth)
    kvs = [blob if x is kv else fm.kv_blob(x) for x in fm.kvs]
    return rebuild(fm, kvs=kvs), f"{kv.key} as arrays nested {depth} deep", "refuse"


def version(fm: FileMap, rng: random.Random):
    new = rng.choice(
        [0, 1, 4, 5, 2, 0x03000000, 0x02000000, 2**32 - 1, 3 ^ (1 << rng.randrange(32))]
    )
    expect = "any" if new in (2, 3) else "refuse"
    return _patch(fm, 4, struct.pack("<I", new)), f"version {fm.version} -> {new}", expect


def magic(fm: FileMap, rng: random.Random):
    at = rng.randrange(4)
    new = rng.choice([b for b in range(256) if b != fm.data[at]])
    return _patch(fm, at, bytes([new])), f"magic byte {at} -> {new:#04x}", "refuse"


CLASSES = {
    "header-bitflip": header_bitflip,
    "value-bitflip": value_bitflip,
    "data-bitflip": data_bitflip,
    "truncate": truncate,
    "oversize": oversize,
    "tensor-type": tensor_type,
    "value-type": value_type,
    "wrong-value": wrong_value,
    "duplicate-key": duplicate_key,
    "duplicate-tensor": duplicate_tensor,
    "drop-tensor": drop_tensor,
    "count": count,
    "offset": move_offset,
    "nested": nested,
    "version": version,
    "magic": magic,
}


@dataclass(frozen=True)
class Mutant:
    index: int
    cls: str
    label: str
    expect: str  # "refuse", "any" or "load"
    data: bytes


def mutant(fm: FileMap, seed: int, index: int) -> Mutant:
    """Mutant `index` of the stream `seed`: index 0 is the original file (the control), the
    others one corruption each, of a class drawn uniformly."""
    if index == 0:
        return Mutant(0, "control", "the original file", "load", fm.data)
    rng = random.Random(f"{seed}:{index}")
    cls = rng.choice(sorted(CLASSES))
    data, label, expect = CLASSES[cls](fm, rng)
    return Mutant(index, cls, label, expect, data)
