"""llama.cpp GGUF -> pyruntime GGUF: the routed experts repacked into our neuron layout, once.

`repack(src, dest)` reads a file in llama.cpp's layout (pyruntime.model.llamacpp_layout) and
writes the same model in ours (docs/gguf-layout.md), streamed one expert at a time (memory stays
at one expert's rows, whatever the model's size), atomically (pyruntime.output_files):

- routed experts: ffn_gate_exps[e], ffn_up_exps[e] and ffn_down_exps[e] become expert e of
  ffn_gud_exps, neuron j's rows (gate[j], up[j], down[:, j]) side by side. Gate and up rows are
  copied byte for byte; down is stored along n_ff_exp in llama.cpp and along n_embd in ours, so
  it is dequantized, transposed and quantized again in the same format (exact for F32, F16 and
  BF16; for the quantized formats one more rounding: pass `outtype` f32 for a lossless copy; the
  K-quants are quantized as llama-quantize does, by the C core on all cores, at disk speed);
  the three take one format, the most precise of theirs (llama-quantize's _M mixes give ffn_down
  more bits in some layers: there gate and up are converted to down's format);
- llama and granitemoe (llama.cpp's NORM rope): the rows of attn_q and attn_k put back in
  Hugging Face's order (llama.cpp's converter permutes them per head; our runtime ropes as HF);
- small tensors (norms, biases, routers, the shared-expert gate) stored as F32, as our layout
  asks; every other tensor copied as it is;
- metadata: every key of the source, plus ours (pyruntime.layout_version, hf_architecture,
  expert_activation) and the values llama.cpp assumes where the source leaves a key out
  (expert_weights_norm, expert_feed_forward_length, ...), so the output reads the same with our
  reader; `pyruntime.source.*` record the source's size, mtime and header hash (repack_cache.py
  decides from them whether a cached copy is still the source's).

With `outtype` (converter's --outtype values) every weight is stored in that format instead.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from tqdm import tqdm

from pyruntime.converter.tensors import (
    OUTTYPES,
    choose_qtype,
    dequantize_rows,
    quantize_rows,
    tensor_nbytes,
)
from pyruntime.errors import ModelFileError, UsageError
from pyruntime.gguf.file import GGUFFile, TensorView
from pyruntime.gguf.header import LazyStrings, NumericArray
from pyruntime.model.layout import LAYOUT_VERSION
from pyruntime.model.llamacpp_layout import (
    EXPERT_PROJECTIONS,
    LlamaCppHParams,
    check_tensors,
    check_types,
    unpermute_rows,
)
from pyruntime.output_files import atomic_output, size_text

Q = GGMLQuantizationType
V = GGUFValueType
# Bumped when the repack's output changes, so cached copies of an older repack are remade.
REPACK_VERSION = 1
SOURCE_KEYS = ("pyruntime.source.size", "pyruntime.source.mtime_ns",
               "pyruntime.source.header_sha256", "pyruntime.repack_version")  # fmt: skip
# Precision order for a layer whose three expert tensors differ in format: the best one wins.
# (By bits per weight: 4.5, 4.5, 5.5, 5.5, 6, 6.6, 8.5, 16, 16, 32.)
_PRECISION = (Q.Q4_0, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q5_1, Q.Q6_K, Q.Q8_0, Q.BF16, Q.F16, Q.F32)
_SMALL_SUFFIXES = ("_norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


@dataclass(frozen=True)
class SourceIdentity:
    """What identifies the source a repacked file was made from."""

    size: int
    mtime_ns: int
    header_sha256: str

    @classmethod
    def of(cls, f: GGUFFile) -> SourceIdentity:
        st = os.stat(f.path)
        return cls(st.st_size, st.st_mtime_ns, f.header_sha256())

    @classmethod
    def recorded_in(cls, f: GGUFFile) -> SourceIdentity | None:
        """The identity a repacked file records, or None (not a repack of this version)."""
        if f.get("pyruntime.repack_version", None) != REPACK_VERSION:
            return None
        size, mtime, digest = (f.get(k, None) for k in SOURCE_KEYS[:3])
        if not isinstance(size, int) or not isinstance(mtime, int) or not isinstance(digest, str):
            return None
        return cls(size, mtime, digest)


@dataclass
class OutTensor:
    """One tensor of the output: its name, row-major shape, format, and a generator of its bytes
    in chunks of whole rows (duck-types what GGUFWriter.write_tensor_data uses: nbytes, tofile)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]
    progress: Callable[[int], None] | None = None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.qtype)

    def tofile(self, fout: Any) -> None:
        written = 0
        for chunk in self.chunks():
            data = np.ascontiguousarray(chunk).view(np.uint8)
            data.tofile(fout)
            written += data.nbytes
            if self.progress is not None:
                self.progress(data.nbytes)
        if written != self.nbytes:  # a recipe bug, not a user error
            raise AssertionError(f"{self.name}: wrote {written} bytes, expected {self.nbytes}")


# ---- bytes in, bytes out ------------------------------------------------------------------------


def _rows(t: TensorView) -> np.ndarray:
    """The tensor's bytes as uint8 [*shape[:-1], row_bytes] (a view of the mapping)."""
    return np.asarray(t.data).view(np.uint8).reshape(*t.shape[:-1], -1)


def _floats(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 [shape] from stored bytes (a view of whole rows)."""
    return dequantize_rows(raw, qtype, shape)


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """uint8 [rows, row_bytes] of float32 `values` [rows, n] in `qtype`."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return quantize_rows(values, qtype).view(np.uint8).reshape(values.shape[0], -1)


def _convert(raw: np.ndarray, src: GGMLQuantizationType, dst: GGMLQuantizationType,
             n: int) -> np.ndarray:  # fmt: skip
    """Rows `raw` (uint8 [rows, row_bytes]) of `src` in `dst`: the bytes themselves when the
    formats agree."""
    if src == dst:
        return raw
    return _encode(_floats(raw, src, (raw.shape[0], n)), dst)


def _fits(qtype: GGMLQuantizationType, row_len: int) -> GGMLQuantizationType:
    """`qtype`, or F16 where its blocks do not tile a row (the converter's rule)."""
    return qtype if row_len % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


# ---- the tensor plan ----------------------------------------------------------------------------


class _Plan:
    def __init__(self, f: GGUFFile, hp: LlamaCppHParams, outtype: str | None) -> None:
        self.f, self.hp, self.outtype = f, hp, outtype

    def weight_type(self, t: TensorView, kind: str = "weight") -> GGMLQuantizationType:
        if self.outtype is None:
            return _fits(t.qtype, t.shape[-1])
        return choose_qtype(kind, t.shape[-1], self.outtype, t.name,  # type: ignore[arg-type]
                            self.hp.n_layer)  # fmt: skip

    def tensors(self) -> list[OutTensor]:
        out: list[OutTensor] = []
        for name, t in self.f.tensors.items():
            if name.endswith(("ffn_up_exps.weight", "ffn_down_exps.weight")):
                continue  # with the layer's gate
            if name.endswith("ffn_gate_exps.weight"):
                out.append(self.experts(name.removesuffix(".ffn_gate_exps.weight")))
            elif name.endswith(_SMALL_SUFFIXES) or len(t.shape) == 1:
                out.append(self.small(name, t))
            else:
                out.append(self.matrix(name, t))
        return out

    def small(self, name: str, t: TensorView) -> OutTensor:
        """A norm, bias, router or gate vector: F32 (the shared-expert gate as [n_embd])."""
        shape = (t.shape[-1],) if name.endswith("ffn_gate_inp_shexp.weight") else t.shape

        def chunks() -> Iterator[np.ndarray]:
            yield _floats(t.data, t.qtype, t.shape).reshape(shape)

        return OutTensor(name, shape, Q.F32, chunks)

    def matrix(self, name: str, t: TensorView) -> OutTensor:
        kind = "embd" if name in ("token_embd.weight", "output.weight") else "weight"
        qtype = self.weight_type(t, kind)
        order = self.row_order(name, t)

        def chunks() -> Iterator[np.ndarray]:
            rows = _rows(t)
            if order is not None:
                rows = rows[order]
            step = max(1, (64 << 20) // rows.shape[1])  # 64 MB of source rows at a time
            for r0 in range(0, rows.shape[0], step):
                yield _convert(rows[r0 : r0 + step], t.qtype, qtype, t.shape[-1])

        return OutTensor(name, t.shape, qtype, chunks)

    def row_order(self, name: str, t: TensorView) -> np.ndarray | None:
        """Hugging Face's row order of a q or k projection llama.cpp permuted, else None."""
        if not self.hp.family.rope_norm:
            return None
        if name.endswith("attn_q.weight"):
            return unpermute_rows(t.shape[0], self.hp.n_head)
        if name.endswith("attn_k.weight"):
            return unpermute_rows(t.shape[0], self.hp.n_head_kv)
        return None

    def experts(self, blk: str) -> OutTensor:
        """blk.N.ffn_gud_exps.weight [E, n_ff, 3, n_embd] from the three projection tensors."""
        gate, up, down = (self.f.tensors[f"{blk}.ffn_{p}_exps.weight"] for p in EXPERT_PROJECTIONS)
        n_expert, n_ff, n = gate.shape
        if self.outtype is None:
            best = max((gate.qtype, up.qtype, down.qtype), key=_PRECISION.index)
            qtype = _fits(best, n)
        else:
            qtype = choose_qtype("experts", n, self.outtype, f"{blk}.ffn_gud_exps.weight",
                                 self.hp.n_layer)  # fmt: skip

        def chunks() -> Iterator[np.ndarray]:
            g_rows, u_rows, d_rows = _rows(gate), _rows(up), _rows(down)
            for e in range(n_expert):
                g = _convert(g_rows[e], gate.qtype, qtype, n)  # [n_ff, row_bytes]
                u = _convert(u_rows[e], up.qtype, qtype, n)
                d = _encode(_floats(d_rows[e], down.qtype, (n, n_ff)).T, qtype)
                yield np.stack([g, u, d], axis=1)  # [n_ff, 3, row_bytes]: neuron-contiguous

        return OutTensor(f"{blk}.ffn_gud_exps.weight", (n_expert, n_ff, 3, n), qtype, chunks)


# ---- metadata -----------------------------------------------------------------------------------


def _metadata(f: GGUFFile, hp: LlamaCppHParams, outtype: str | None,
              source: SourceIdentity) -> dict[str, tuple[Any, GGUFValueType, Any]]:  # fmt: skip
    """key -> (value, type, element type) of the output: the source's keys, then ours."""
    out: dict[str, tuple[Any, GGUFValueType, Any]] = {}
    for key, value in f.metadata.items():
        if key in ("general.architecture", "general.alignment") or key.startswith("pyruntime."):
            continue
        sig = f.signatures[key]
        if sig[0] == V.ARRAY:
            if isinstance(value, (NumericArray, LazyStrings)):
                value = value.tolist() if isinstance(value, NumericArray) else list(value)
            if not value:
                continue  # gguf-py writes no empty array; an empty one says nothing anyway
            out[key] = (value, V.ARRAY, sig[1])
        else:
            out[key] = (value, sig[0], None)
    a = hp.arch
    if a == "granitemoe":  # llama.cpp: a scale of 0 means none; ours: absent means none
        for k in ("embedding_scale", "residual_scale", "attention.scale"):
            if out.get(f"{a}.{k}", (None,))[0] == 0.0:
                del out[f"{a}.{k}"]
    u32 = V.UINT32
    out.setdefault(f"{a}.expert_weights_norm", (hp.family.expert_weights_norm, V.BOOL, None))
    out[f"{a}.expert_feed_forward_length"] = (hp.n_ff_exp, u32, None)
    if hp.n_ff_shexp:
        out[f"{a}.expert_shared_feed_forward_length"] = (hp.n_ff_shexp, u32, None)
    out.setdefault(f"{a}.vocab_size", (hp.n_vocab, u32, None))
    if outtype is not None:
        out["general.file_type"] = (int(OUTTYPES[outtype][1]), u32, None)
    out["pyruntime.layout_version"] = (LAYOUT_VERSION, u32, None)
    out["pyruntime.hf_architecture"] = (hp.family.hf_architecture, V.STRING, None)
    out["pyruntime.expert_activation"] = ("silu", V.STRING, None)  # every supported family
    out["pyruntime.source.size"] = (source.size, V.UINT64, None)
    out["pyruntime.source.mtime_ns"] = (source.mtime_ns, V.INT64, None)
    out["pyruntime.source.header_sha256"] = (source.header_sha256, V.STRING, None)
    out["pyruntime.repack_version"] = (REPACK_VERSION, u32, None)
    return out


# ---- the repack ---------------------------------------------------------------------------------


def plan(f: GGUFFile, outtype: str | None = None) -> tuple[LlamaCppHParams, list[OutTensor]]:
    """The hyper-parameters and output tensors of `f` (a llama.cpp-layout file), after every
    check of llama.cpp's layout (one ModelFileError line for the first problem)."""
    if outtype is not None and outtype not in OUTTYPES:
        raise UsageError(f"unknown outtype {outtype!r}; use one of {', '.join(OUTTYPES)}")
    check_types(f)
    hp = LlamaCppHParams.from_gguf(f)
    if hp.arch == "granitemoe" and f.arch_get("logit_scale", None) is None:
        raise ModelFileError(f"{f.path}: metadata key 'granitemoe.logit_scale' is missing")
    check_tensors(f, hp)
    return hp, _Plan(f, hp, outtype).tensors()


def repack(f: GGUFFile, dest: Path, outtype: str | None = None, progress: bool = True) -> Path:
    """Write `f` (llama.cpp's layout) to `dest` in ours (module doc); returns `dest`."""
    hp, tensors = plan(f, outtype)
    source = SourceIdentity.of(f)
    total = sum(t.nbytes for t in tensors)
    _check_space(dest, total + f.data_start)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="repacking", file=sys.stderr,
               disable=not progress)  # fmt: skip
    try:
        with atomic_output(dest) as tmp:
            writer = GGUFWriter(tmp, hp.arch)
            try:
                for key, (value, vtype, sub) in _metadata(f, hp, outtype, source).items():
                    writer.add_key_value(key, value, vtype, sub)
                for t in tensors:
                    t.progress = bar.update
                    writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                                           t.qtype)  # fmt: skip
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for t in tensors:
                    writer.write_tensor_data(t)  # type: ignore[arg-type]  # duck-typed
            finally:
                writer.close()
    except OSError as exc:
        raise ModelFileError(
            f"{dest}: writing the repacked GGUF failed ({exc.strerror or exc}); nothing was written"
        ) from None
    finally:
        bar.close()
    return dest


def _check_space(dest: Path, need: int) -> None:
    free = shutil.disk_usage(dest.parent).free
    if free < need + (16 << 20):
        raise ModelFileError(
            f"{dest.parent}: the repacked GGUF needs about {size_text(need)} and the folder "
            f"has {size_text(free)} free (set PYRUNTIME_CACHE to a folder with room, or give "
            "`pyruntime repack IN -o OUT` another place)"
        )
