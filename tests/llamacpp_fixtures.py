"""GGUFs in llama.cpp's layout for tests, made from our converter's files the way llama.cpp's
converter (convert_hf_to_gguf.py of llama.cpp) lays the same checkpoint out:

- routed experts as ffn_gate_exps / ffn_up_exps [E, n_ff, n_embd] and ffn_down_exps
  [E, n_embd, n_ff] (down quantized along n_ff);
- llama and granitemoe: attn_q / attn_k rows permuted per head (llama.cpp's LlamaModel.permute,
  copied here: its NORM rope pairs adjacent values);
- qwen2moe's shared-expert gate as [1, n_embd];
- none of our keys (pyruntime.*, tokenizer.huggingface.json), no expert_weights_norm, and
  expert_feed_forward_length only where llama.cpp's converter writes it (qwen).

Independent of pyruntime's repack (numpy and gguf-py only), so a test of the repack checks it
against llama.cpp's layout rather than against itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType
NORM_ROPE = ("llama", "granitemoe")
QWEN = ("qwen2moe", "qwen3moe")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rows of a q or k projection, or their bytes)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _add(w: GGUFWriter, name: str, data: np.ndarray, shape: tuple[int, ...], qtype: Q) -> None:
    """Tensor `name` of row-major `shape` in `qtype` from its bytes (any array of them)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(*shape[:-1], -1)
    w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)


def _value(field):
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def to_llamacpp(src: Path, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    """Write `src` (our layout) to `dest` in llama.cpp's layout (module doc); keys in `drop`
    are left out too."""
    r = GGUFReader(src)
    arch = _value(r.fields["general.architecture"])
    meta = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    n_head = _value(meta[f"{arch}.attention.head_count"])
    n_head_kv = _value(meta[f"{arch}.attention.head_count_kv"])
    skip = {"general.architecture", "tokenizer.huggingface.json", f"{arch}.expert_weights_norm",
            *drop}  # fmt: skip
    if arch not in QWEN:
        skip.add(f"{arch}.expert_feed_forward_length")
    w = GGUFWriter(dest, arch)
    for key, field in meta.items():
        if key in skip or key.startswith("pyruntime."):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, _value(field), field.types[0], sub)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # row-major
        data = np.asarray(t.data)
        if t.name.endswith("ffn_gud_exps.weight"):
            n_expert, n_ff, _, n = shape
            rows = data.view(np.uint8).reshape(n_expert, n_ff, 3, -1)
            blk = t.name.removesuffix(".ffn_gud_exps.weight")
            q = t.tensor_type
            _add(w, f"{blk}.ffn_gate_exps.weight", rows[:, :, 0], (n_expert, n_ff, n), q)
            _add(w, f"{blk}.ffn_up_exps.weight", rows[:, :, 1], (n_expert, n_ff, n), q)
            down = dequantize(np.ascontiguousarray(rows[:, :, 2]), q).reshape(n_expert, n_ff, n)
            down = np.ascontiguousarray(down.transpose(0, 2, 1), dtype=np.float32)  # [E, n, ff]
            _add(w, f"{blk}.ffn_down_exps.weight", quantize(down, q), (n_expert, n, n_ff), q)
            continue
        raw = data.view(np.uint8).reshape(shape[0], -1) if len(shape) > 1 else data
        if arch in NORM_ROPE and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = n_head if t.name.endswith("attn_q.weight") else n_head_kv
            raw = np.ascontiguousarray(permute(raw, heads))
        if t.name.endswith("ffn_gate_inp_shexp.weight"):
            shape = (1, shape[0])
        _add(w, t.name, raw, shape, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


# ---- llama-quantize's type mix ------------------------------------------------------------------

# ftype -> (the default type, the type of the tensors llama.cpp gives more bits: output.weight,
# and attn_v / ffn_down* in the layers `use_more_bits` picks); Q6_K has one type throughout
# (output.weight too). llama-quantize's choice for these ftypes (src/llama-quant.cpp).
KQUANT_MIXES = {"Q4_K_M": (Q.Q4_K, Q.Q6_K), "Q5_K_M": (Q.Q5_K, Q.Q6_K), "Q6_K": (Q.Q6_K, Q.Q6_K)}
# Where a row is not a multiple of 256 (tensor_type_fallback)
KQUANT_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third."""
    return (
        i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2
    )


def kquant_type(name: str, row_len: int, n_layer: int, ftype: str) -> Q | None:
    """The type llama-quantize `ftype` gives tensor `name` (rows of `row_len`), or None for the
    tensors it leaves in F32 (norms, routers, vectors)."""
    if name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return None
    base, more = KQUANT_MIXES[ftype]
    qtype = base
    if name == "output.weight":
        qtype = more
    elif name.startswith("blk.") and name.endswith(
        ("attn_v.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_down.weight")
    ):
        qtype = more if use_more_bits(int(name.split(".")[1]), n_layer) else base
    return KQUANT_FALLBACK[qtype] if row_len % 256 else qtype


def llama_quantize(src: Path, dest: Path, ftype: str, k_quantize) -> Path:
    """What `llama-quantize src dest ftype` writes for `src` (a llama.cpp-layout F32 file): each
    matrix in kquant_type's format. The legacy formats by gguf-py's quantizer; the K-quants (which
    gguf-py cannot make) by `k_quantize(values [rows, n] f32, qtype) -> bytes`."""
    r = GGUFReader(src)
    arch = _value(r.fields["general.architecture"])
    n_layer = _value(r.fields[f"{arch}.block_count"])
    w = GGUFWriter(dest, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, _value(field), field.types[0], sub)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # row-major
        values = np.asarray(t.data, dtype=np.float32).reshape(shape)
        qtype = kquant_type(t.name, shape[-1], n_layer, ftype) if len(shape) > 1 else None
        if qtype is None:
            _add(w, t.name, values, shape, Q.F32)
            continue
        rows = np.ascontiguousarray(values.reshape(-1, shape[-1]))
        raw = k_quantize(rows, qtype) if qtype.name.endswith("_K") else quantize(rows, qtype)
        _add(w, t.name, raw, shape, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
