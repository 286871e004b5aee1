"""Output tensors: what to write, in which GGUF type, and how its bytes are produced.

An `OutTensor` is a recipe: its GGUF name, row-major element shape, a dtype class (`kind`), and
a generator of float32 chunks whose C-order concatenation is the tensor. Every chunk holds whole
rows, so each chunk can be quantized on its own (quantization blocks run along a row). Experts
are produced one expert per chunk: memory stays bounded by one expert, not one layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from math import prod
from typing import IO, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import quantize

from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.core import CoreError, CpuCore
from pyruntime.gguf.quant import dequantize

Q = GGMLQuantizationType

# --outtype -> (weight type W, general.file_type)
OUTTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    # the routed experts MXFP4, every other matrix Q8_0 (llama.cpp's MXFP4_MOE)
    "mxfp4": (Q.Q8_0, LlamaFileType.MOSTLY_MXFP4_MOE),
    # llama-quantize's K-quant mixes (K_MIXES)
    "q4_k_m": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
}
EXPERT_TYPES = {"mxfp4": Q.MXFP4}  # outtypes whose routed experts differ from W

# K-quant outtype -> (its type, the type of the tensors llama-quantize gives more bits: output,
# and in the layers of use_more_bits attn_v and the FFN's down projection; ours keeps down in
# ffn_gud_exps beside gate and up, so there the whole expert tensor takes it). llama.cpp's
# extra rules for models of exactly 8 experts (attn_k / attn_v Q8_0, attn_output Q5_K) are not
# followed.
K_MIXES = {"q4_k_m": (Q.Q4_K, Q.Q6_K), "q5_k_m": (Q.Q5_K, Q.Q6_K), "q6_k": (Q.Q6_K, Q.Q6_K)}
# Where a row is not a multiple of 256, llama-quantize's fallback (tensor_type_fallback)
K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_MORE_BITS = (
    "attn_v.weight",
    "ffn_down.weight",
    "ffn_down_shexp.weight",
    "ffn_gud_exps.weight",
    "ffn_down_exps.weight",
)  # the last: llama.cpp's layout (bench files)
# The formats gguf-py cannot quantize to: the C core quantizes them, as llama-quantize does (its
# bytes, bit for bit), on a pool of the machine's cores. (pyruntime.kernels.block_codecs' torch
# encoders are a different search, kept for the kernels' test weights, not for files.)
_K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)

# Elements quantized at once: gguf-py's MXFP4 quantizer holds 16 candidates per element (64
# bytes), so one gpt-oss-20b expert (25M elements) at once would take 1.6 GB.
QUANTIZE_ELEMENTS = 1 << 20

# weight: type W; experts (the routed experts): W, or EXPERT_TYPES[outtype]; embd: W, but Q8_0
# when W is Q4_0 (token_embd/output, as llama.cpp); f32: norms, biases, routers, sinks,
# shared-expert gate.
Kind = Literal["weight", "experts", "embd", "f32"]


@dataclass
class OutTensor:
    name: str
    shape: tuple[int, ...]  # row-major, outermost first; shape[-1] is the row length
    kind: Kind
    chunks: Callable[[], Iterator[np.ndarray]]  # float32 pieces of whole rows, in C order


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quantize's choice of layers for more bits: the first and last eighth, every third."""
    eighth = n_layer // 8
    return i_layer < eighth or i_layer >= 7 * n_layer // 8 or (i_layer - eighth) % 3 == 2


def _k_mix(outtype: str, name: str, n_layer: int) -> GGMLQuantizationType:
    base, more = K_MIXES[outtype]
    if name == "output.weight":
        return more
    if name.startswith("blk.") and name.endswith(_MORE_BITS):
        return more if use_more_bits(int(name.split(".")[1]), n_layer) else base
    return base


def choose_qtype(kind: Kind, row_len: int, outtype: str, name: str = "",
                 n_layer: int = 0) -> GGMLQuantizationType:  # fmt: skip
    """The GGUF type of a tensor under `outtype` (rules of docs/gguf-layout.md, 'Tensors'); the
    K-quant mixes also look at the tensor's `name` and the model's `n_layer`."""
    if kind == "f32":
        return Q.F32
    weight_type = OUTTYPES[outtype][0]
    if kind == "experts":
        weight_type = EXPERT_TYPES.get(outtype, weight_type)
    if outtype in K_MIXES:
        weight_type = _k_mix(outtype, name, n_layer)
    if kind == "embd" and weight_type == Q.Q4_0:
        weight_type = Q.Q8_0
    block = GGML_QUANT_SIZES[weight_type][0]
    if row_len % block:
        fallback = K_FALLBACK.get(weight_type, Q.F16)
        if row_len % GGML_QUANT_SIZES[fallback][0] == 0:
            return fallback  # llama-quantize's, for a K-quant
        return Q.F16  # blocks must tile a row exactly; fall back as the layout doc says
    return weight_type


@cache
def _core_pool() -> CpuCore:
    """The C core's thread pool the K-quant rows are (de)quantized on, one per process; CoreError
    (one line: where the library was looked for, how to build it) where the core is not built."""
    return CpuCore()


def quantize_rows(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 rows [r, n] -> their bytes in `qtype` (gguf-py's quantizer; the K-quants the C
    core's: llama-quantize's bytes)."""
    if qtype in _K_QUANTS:
        try:
            pool = _core_pool()
        except CoreError as exc:
            raise CoreError(f"{qtype.name} output is quantized by the C core: {exc}") from None
        return cpu_core.quantize_rows(rows, int(qtype), pool)
    return quantize(rows, qtype)


def dequantize_rows(raw: np.ndarray, qtype: GGMLQuantizationType,
                    shape: tuple[int, ...]) -> np.ndarray:  # fmt: skip
    """float32 [shape] from the stored bytes `raw` of whole rows: the K-quants on the C core's
    threads, the torch decoders where it is not built (the same values)."""
    if qtype in _K_QUANTS:
        try:
            pool = _core_pool()
        except CoreError:
            pool = None
        if pool is not None:
            return cpu_core.dequantize_rows(raw, int(qtype), shape[-1], pool).reshape(shape)
    return dequantize(raw, qtype, shape).numpy()


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return prod(shape[:-1]) * (shape[-1] // block) * block_bytes


class StreamedTensor:
    """Duck-types the two things `GGUFWriter.write_tensor_data` uses (`nbytes`, `tofile`) so a
    tensor's data is written chunk by chunk without materializing it."""

    def __init__(self, out: OutTensor, qtype: GGMLQuantizationType) -> None:
        self.out = out
        self.qtype = qtype
        self.nbytes = tensor_nbytes(out.shape, qtype)

    def tofile(self, fout: IO[bytes]) -> None:
        written = 0
        row_len = self.out.shape[-1]
        for chunk in self.out.chunks():
            if chunk.shape[-1] != row_len:
                raise AssertionError(f"{self.out.name}: chunk rows {chunk.shape} != {row_len}")
            rows = np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1, row_len)
            step = max(1, QUANTIZE_ELEMENTS // row_len)
            for r0 in range(0, rows.shape[0], step):  # whole rows at a time: the same bytes
                data = quantize_rows(rows[r0 : r0 + step], self.qtype)
                data.tofile(fout)
                written += data.nbytes
        if written != self.nbytes:  # a recipe bug, not a user error
            raise AssertionError(f"{self.out.name}: wrote {written} bytes, expected {self.nbytes}")
