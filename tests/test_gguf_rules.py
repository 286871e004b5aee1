"""The reader's and the layout's rules, one corruption each: a one-line ModelFileError naming the
file and the key or tensor, never another exception (issue 20's list of faults)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFWriter
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import open_gguf
from pyruntime.model.config import ModelConfig
from pyruntime.tools import gguf_map as gm
from pyruntime.tools.demo import DEMO_SOURCE

A = "olmoe"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> gm.FileMap:
    path = convert(DEMO_SOURCE, tmp_path_factory.mktemp("demo") / "d.gguf", "q8_0", progress=False)
    return gm.map_file(path.read_bytes())


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> gm.FileMap:
    tmp = tmp_path_factory.mktemp("qwen2")
    path = convert(make_tiny_hf_model("qwen2moe", tmp / "hf"), tmp / "q.gguf", "f32", False)
    return gm.map_file(path.read_bytes())


def load(tmp_path, data: bytes) -> ModelConfig:
    """Open and check the file as Model does (reader, hyper-parameters, every tensor)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return ModelConfig.from_gguf(open_gguf(path))


def refused(tmp_path, data: bytes, *fragments: str) -> str:
    with pytest.raises(ModelFileError) as info:
        load(tmp_path, data)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "m.gguf")), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def with_kv(fm: gm.FileMap, key: str, vtype: int, value) -> bytes:
    """The file with `key` set to `value` stored as `vtype` (replaced in place, or added)."""
    blob = gm.kv_blob(key, vtype, value)
    kvs = [blob if k.key == key else fm.kv_blob(k) for k in fm.kvs]
    if all(k.key != key for k in fm.kvs):
        kvs.append(blob)
    return gm.rebuild(fm, kvs=kvs)


def test_the_original_loads_and_rebuilds_byte_for_byte(demo, tmp_path):
    assert gm.rebuild(demo) == demo.data
    assert load(tmp_path, demo.data).n_layer == 4


@pytest.mark.parametrize(
    "key, vtype, value, fragments",
    [
        (f"{A}.attention.layer_norm_rms_epsilon", gm.U32, 1, ["stored as UINT32", "FLOAT32"]),
        (f"{A}.expert_weights_norm", gm.STRING, "true", ["stored as STRING", "expected BOOL"]),
        (f"{A}.block_count", gm.STRING, "4", [f"'{A}.block_count' is stored as STRING"]),
        (f"{A}.block_count", gm.I32, -2, [f"'{A}.block_count' is stored as INT32"]),
        (f"{A}.block_count", gm.U32, 2, ["'blk.2.attn_norm.weight' is not part of"]),
        (f"{A}.block_count", gm.U32, 0, [f"'{A}.block_count' is 0, outside [1, 2^31)"]),
        # 2^27 + 4 (a bit flip): refused at once, not after listing 2^27 layers' tensors
        (f"{A}.block_count", gm.U32, 2**27 + 4, ["holds tensors of 4 layers (no blk.4.*"]),
        (f"{A}.block_count", gm.U32, 5, ["is 5, but the file holds tensors of 4 layers"]),
        (f"{A}.block_count", gm.U32, 2**32 - 1, ["is 4294967295, outside"]),
        (f"{A}.attention.head_count", gm.U32, 0, [f"'{A}.attention.head_count' is 0"]),
        (f"{A}.attention.head_count", gm.ARRAY, (gm.I32, [4, 4]), ["expected one integer"]),
        (f"{A}.attention.head_count_kv", gm.U32, 3, ["not a multiple of head_count_kv 3"]),
        (f"{A}.expert_used_count", gm.U32, 17, ["expert_used_count 17 not in 1..16"]),
        (f"{A}.attention.layer_norm_rms_epsilon", gm.F32, float("nan"), ["expected a finite"]),
        (f"{A}.rope.freq_base", gm.F32, 0.0, ["expected a finite float > 0"]),
        (f"{A}.attention.value_length", gm.U32, 32, ["value_length 32 differs"]),
        ("general.alignment", gm.U32, 3, ["'general.alignment' is 3, not a power of two"]),
        ("general.alignment", gm.U64, 32, ["'general.alignment' is stored as UINT64"]),
        ("general.architecture", gm.STRING, "falcon", ["architecture 'falcon' is not supported"]),
        ("pyruntime.layout_version", gm.U32, 2, ["layout version 2 is not supported"]),
        ("pyruntime.layout_version", gm.STRING, "1", ["'pyruntime.layout_version' is stored as"]),
        ("pyruntime.expert_activation", gm.STRING, "relu", ["unknown expert activation 'relu'"]),
        ("tokenizer.ggml.add_bos_token", gm.U8, 1, ["stored as UINT8, expected BOOL"]),
        ("pyruntime.stop_token_ids", gm.ARRAY, (gm.STRING, ["0"]), ["ARRAY[STRING]"]),
    ],
)
def test_known_keys_are_type_and_range_checked(demo, tmp_path, key, vtype, value, fragments):
    refused(tmp_path, with_kv(demo, key, vtype, value), *fragments)


def test_a_larger_alignment_moves_the_tensor_data(demo, tmp_path):
    """general.alignment 64 on a file padded to 32: the reader looks for the data at the next
    64-byte boundary, 32 bytes on, and finds the file too short. general.name is sized so that
    the header ends between two 64-byte boundaries whatever else the converter writes."""
    kvs = [k for k in demo.kvs if k.key not in ("general.alignment", "general.name")]
    blobs = [demo.kv_blob(k) for k in kvs] + [gm.kv_blob("general.alignment", gm.U32, 64)]
    tensors = [demo.tensor_blob(t) for t in demo.tensors]
    header = 24 + sum(map(len, blobs + tensors)) + len(gm.kv_blob("general.name", gm.STRING, ""))
    name = "x" * ((16 - header) % 64)  # the header ends 16 bytes past a 64-byte boundary
    data = gm.rebuild(demo, kvs=blobs + [gm.kv_blob("general.name", gm.STRING, name)])
    refused(tmp_path, data, "the tensor data ends at")


def test_duplicates_are_refused(demo, tmp_path):
    block_count = next(k for k in demo.kvs if k.key == f"{A}.block_count")
    kvs = [demo.kv_blob(k) for k in demo.kvs] + [gm.kv_blob(block_count.key, gm.U32, 2)]
    refused(tmp_path, gm.rebuild(demo, kvs=kvs), f"'{A}.block_count' appears twice")
    a, b = demo.tensors[3], demo.tensors[7]
    tensors = [demo.tensor_blob(t, name=b.name if t is a else None) for t in demo.tensors]
    refused(tmp_path, gm.rebuild(demo, tensors=tensors), f"tensor {b.name!r} appears twice")


def _patched(fm: gm.FileMap, at: int, fmt: str, value) -> bytes:
    return fm.data[:at] + struct.pack(fmt, value) + fm.data[at + struct.calcsize(fmt) :]


def test_tensor_data_must_be_in_order_aligned_and_contiguous(demo, tmp_path):
    t = demo.tensors[5]
    offset_at = t.end - 8
    refused(tmp_path, _patched(demo, offset_at, "<Q", t.offset + 1), "not aligned to 32 bytes")
    refused(tmp_path, _patched(demo, offset_at, "<Q", t.offset + 32), "a gap or overlap")
    refused(tmp_path, _patched(demo, offset_at, "<Q", 0), f"{t.name!r} starts at data offset 0")
    refused(tmp_path, demo.data + b"\0" * 32, "32 bytes follow the end of the tensor data")
    refused(tmp_path, demo.data[:-1], "truncated file")
    # one tensor short: the count says so, the bytes do not
    refused(tmp_path, _patched(demo, 8, "<Q", len(demo.tensors) - 1), "bytes follow the end")


def test_tensor_tables_bounds_and_types(demo, tmp_path):
    t = demo.tensors[1]  # blk.0.attn_norm.weight, F32 [192]
    type_at = t.end - 12
    refused(tmp_path, _patched(demo, type_at, "<I", 4), f"{t.name!r} has unknown ggml type 4")
    refused(tmp_path, _patched(demo, type_at, "<I", 26), f"{t.name!r} is I32; the layout")
    dim_at = t.end - 12 - 8
    for dim, fragment in ((2**62, "too many bytes"), (2**33, "of 34359738368 bytes"),
                          (2**64 - 1, "too many elements"), (193, "of 772 bytes")):  # fmt: skip
        refused(tmp_path, _patched(demo, dim_at, "<Q", dim), fragment)
    n_dims_at = dim_at - 4
    refused(tmp_path, _patched(demo, n_dims_at, "<I", 5), "has 5 dimensions, more than 4")
    refused(tmp_path, _patched(demo, 8, "<Q", 2**40), "cannot fit in the")
    refused(tmp_path, _patched(demo, 16, "<Q", 2**64 - 1), "cannot fit in the")
    for version, fragment in ((1, "version 1 is not"), (4, "version 4 is not"),
                              (0x03000000, "big-endian")):  # fmt: skip
        refused(tmp_path, _patched(demo, 4, "<I", version), fragment)


def test_strings_arrays_and_nesting(demo, tmp_path):
    tokens = next(k for k in demo.kvs if k.key == "tokenizer.ggml.tokens")
    count_at = tokens.value_start + 4
    refused(tmp_path, _patched(demo, count_at, "<Q", 2**62), "over the limit")
    refused(tmp_path, _patched(demo, count_at, "<Q", 2**29), "past the end of the file")
    name = next(k for k in demo.kvs if k.key == "general.name")
    refused(tmp_path, _patched(demo, name.value_start, "<Q", 2**40), "over the limit")
    refused(tmp_path, _patched(demo, name.value_start, "<Q", 2**23), "past the end of the file")
    norm = next(k for k in demo.kvs if k.key == f"{A}.expert_weights_norm")
    refused(tmp_path, _patched(demo, norm.value_start, "<B", 2), "a bool stored as 2")
    for depth in (5, 100_000):
        k = name.key.encode()
        blob = struct.pack("<Q", len(k)) + k + struct.pack("<I", gm.ARRAY) + gm.nested_array(depth)
        kvs = [blob if x is name else demo.kv_blob(x) for x in demo.kvs]
        refused(tmp_path, gm.rebuild(demo, kvs=kvs), "nests arrays more than 4 deep")
    empty = gm.kv_blob("", gm.U32, 1)
    refused(tmp_path, gm.rebuild(demo, kvs=[empty] + [demo.kv_blob(k) for k in demo.kvs]), "empty")
    bad = struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", gm.U8, 0)
    refused(tmp_path, gm.rebuild(demo, kvs=[bad] + [demo.kv_blob(k) for k in demo.kvs]), "UTF-8")


def test_every_tensor_against_the_hyper_parameters(demo, qwen2, tmp_path):
    one_float = np.ones(1, np.float32).tobytes()
    for name in ("output_norm.weight", "blk.2.attn_norm.weight", "blk.3.ffn_norm.weight",
                 "blk.1.attn_q_norm.weight"):  # fmt: skip
        refused(tmp_path, gm.resize_tensor(demo, name, (1,), one_float),
                f"tensor {name!r} has shape [1], but")  # fmt: skip
    refused(tmp_path, gm.resize_tensor(qwen2, "blk.0.attn_q.bias", (1,), one_float),
            "'blk.0.attn_q.bias' has shape [1]")  # fmt: skip
    experts = next(t for t in demo.tensors if t.name == "blk.0.ffn_gud_exps.weight")
    dims = (experts.dims[0], 3, experts.dims[2], experts.dims[3] - 1)  # one expert short
    size = experts.padded_size // experts.dims[3] * dims[3]
    refused(tmp_path, gm.resize_tensor(demo, experts.name, dims, b"\0" * size),
            "'blk.0.ffn_gud_exps.weight' has shape [15, 96, 3, 192]")  # fmt: skip


def test_required_tensors_and_unknown_ones(demo, qwen2, tmp_path):
    drop = next(t for t in demo.tensors if t.name == "blk.1.attn_k_norm.weight")
    blobs, data, offset = [], b"", 0
    for t in demo.tensors:
        if t is not drop:
            blobs.append(demo.tensor_blob(t, offset=offset))
            data += demo.padded(t)
            offset += t.padded_size
    refused(tmp_path, gm.build(demo, [demo.kv_blob(k) for k in demo.kvs], blobs, data),
            "tensor 'blk.1.attn_k_norm.weight' is missing")  # fmt: skip
    renamed = [demo.tensor_blob(t, name="blk.0.attn_z.weight" if i == 2 else None)
               for i, t in enumerate(demo.tensors)]  # fmt: skip
    refused(tmp_path, gm.rebuild(demo, tensors=renamed), "'blk.0.attn_z.weight' is not part of")
    # qwen2moe: the q/k/v biases come together
    bias = next(t for t in qwen2.tensors if t.name == "blk.1.attn_v.bias")
    blobs, data, offset = [], b"", 0
    for t in qwen2.tensors:
        if t is not bias:
            blobs.append(qwen2.tensor_blob(t, offset=offset))
            data += qwen2.padded(t)
            offset += t.padded_size
    refused(tmp_path, gm.build(qwen2, [qwen2.kv_blob(k) for k in qwen2.kvs], blobs, data),
            "'blk.1.attn_v.bias' is missing (the file has 'blk.1.attn_q.bias'")  # fmt: skip


def test_tokenizer_ids_must_be_model_tokens(demo, tmp_path):
    from pyruntime.api import Model

    for key, vtype, value, fragment in (
        ("tokenizer.ggml.eos_token_id", gm.U32, 2**31, "eos token id 2147483648"),
        ("tokenizer.ggml.bos_token_id", gm.U32, 4096, "bos token id 4096"),
        ("pyruntime.stop_token_ids", gm.ARRAY, (gm.I32, [0, -1]), "stop token id -1"),
        ("tokenizer.huggingface.json", gm.STRING, "{}", "not a valid tokenizer.json"),
    ):
        path = tmp_path / "t.gguf"
        path.write_bytes(with_kv(demo, key, vtype, value))
        with pytest.raises(ModelFileError, match=fragment):
            Model(path)


def test_the_reader_is_generic(tmp_path):
    """A GGUF of another layout (no pyruntime keys) opens; the model refuses it by name."""
    path = tmp_path / "other.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = open_gguf(path)
    assert f.arch == "llama" and f.tensors["token_embd.weight"].shape == (8, 32)
    with pytest.raises(ModelFileError, match="pyruntime.layout_version. is missing"):
        ModelConfig.from_gguf(f)
