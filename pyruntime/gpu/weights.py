"""Weights of the GPU executor, uploaded once from the host description (pyruntime.model.weights:
views into the GGUF mmap, already loaded and checked there).

- routed experts: their GGUF bytes on the device, prepared by kernels.dispatch.prepare_experts
  (never dequantized);
- matmul weights (attention, DeltaNet projections, shared experts, dense FFN layers, lm_head)
  and the token embedding: `Linear`, Q8_0 kept quantized (kernels.q8_linear) when the GGUF
  stores Q8_0 or Q4_0 (repacked to Q8_0, exact), else float (f32 for an F32 GGUF, bf16
  otherwise). The embedding has one device copy: the lookup reads it (kernels.q8_embed for Q8_0
  rows, an index_select of the float ones) and a tied lm_head is the same Linear (the hybrid
  leaves an untied one in host memory: pyruntime.offload.embedding);
- norms, routers, the shared-expert gate: float32 (F32 in the GGUF).
A tensor the upload converts (a float cast, a block format dequantized, Q4_0 -> Q8_0) is
converted in chunks of at most LOAD_CHUNK_ELEMENTS weights into its preallocated device tensor,
so loading never holds a whole large tensor twice or in f32. The device memory each part takes
is estimated without uploading, by pyruntime.offload.plan (a test holds the two equal).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pyruntime.errors import UsageError
from pyruntime.experts.store import ExpertStore
from pyruntime.gguf.quant import FORMAT_NAMES, QuantMatrix
from pyruntime.kernels.dispatch import prepare_experts
from pyruntime.kernels.expert_formats import FLOAT_DTYPES, REPACKED, dequantize_rows
from pyruntime.kernels.q8_linear import (
    dequantize_q8,
    q4_0_as_q8_0,
    q8_gemm,
    q8_gemm_max_tokens,
    q8_gemv,
    split_q8_0,
)
from pyruntime.model.config import ModelConfig
from pyruntime.model.deltanet import DeltaNetWeights
from pyruntime.model.mla import MLAWeights
from pyruntime.model.weights import BlockWeights, FFNWeights, HostWeights
from pyruntime.offload.host_register import dma_cuts
from pyruntime.offload.plan import LOAD_CHUNK_ELEMENTS

Q = GGMLQuantizationType

# Decode (T <= this) reads Q8_0 dense weights with the GEMV kernel; more tokens (prefill) take
# the tiled GEMM that dequantizes W's tiles in registers (kernels.q8_linear.q8_gemm), or, past
# the tuning file's "q8_gemm": {"max_tokens": N} (bench/gpu_prefill.py --write: where
# dequantize + cuBLAS measured faster on that GPU), a dequantized copy of W per call for cuBLAS.
Q8_GEMV_MAX_TOKENS = 4


@dataclass
class Linear:
    """y = x @ W^T (+ b), W [N, K]: a float tensor `w`, or Q8_0 kept quantized (q int8 [N, K],
    d f16 [N, K / 32], kernels.q8_linear) when the GGUF stores it so."""

    w: torch.Tensor | None = None
    q: torch.Tensor | None = None
    d: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # [N]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N] in out_dtype (default x's; the Q8_0 GEMV writes it directly)."""
        if self.w is not None:
            y = F.linear(x, self.w, self.bias)
        elif x.shape[0] <= Q8_GEMV_MAX_TOKENS:
            return q8_gemv(x.contiguous(), self.q, self.d, self.bias, out_dtype)
        elif x.shape[0] <= q8_gemm_max_tokens():
            return q8_gemm(x if x.stride(1) == 1 else x.contiguous(), self.q, self.d, self.bias,
                           out_dtype)  # fmt: skip
        else:
            y = F.linear(x, dequantize_q8(self.q, self.d, x.dtype), self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.q, self.d, self.bias)
                   if t is not None)  # fmt: skip

    @staticmethod
    def stack(parts: list[Linear]) -> Linear:
        """One Linear whose rows are the parts' rows in order (e.g. q, k, v -> qkv)."""
        if all(p.w is not None for p in parts):
            return Linear(w=torch.cat([p.w for p in parts]))
        if all(p.q is not None for p in parts):
            return Linear(q=torch.cat([p.q for p in parts]), d=torch.cat([p.d for p in parts]))
        dtype = next(p.w.dtype for p in parts if p.w is not None)
        return Linear(w=torch.cat([p.dense(dtype) for p in parts]))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.w.to(dtype) if self.w is not None else dequantize_q8(self.q, self.d, dtype)


@dataclass
class GatedFFN:
    """act(x W_gu[:n_ff]^T) * (x W_gu[n_ff:]^T) @ W_down^T; gate and up rows stacked."""

    gate_up: Linear  # [2 * n_ff, n_embd]
    down: Linear  # [n_embd, n_ff]


@dataclass
class DeviceDeltaNet:
    """A Gated DeltaNet layer (qwen35moe; kernels.deltanet)."""

    in_proj: Linear  # [C + Hv dv + 2 Hv, n_embd]: qkv, z, b (beta), a (alpha) rows
    conv: torch.Tensor  # [C, K] f32
    a: torch.Tensor  # [Hv] f32: A = -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] f32
    norm: torch.Tensor  # [dv] f32
    out: Linear  # [n_embd, Hv dv]


@dataclass
class DeviceMLA:
    """One MLA layer's attention weights on the device (model.mla.MLAWeights)."""

    q: Linear | None  # [H (nope + rope), n_embd]; None with a query LoRA
    q_a: Linear | None  # [q_rank, n_embd]
    q_a_norm: torch.Tensor | None  # [q_rank] f32
    q_b: Linear | None  # [H (nope + rope), q_rank]
    kv_a: Linear  # [rank + rope, n_embd]
    kv_a_norm: torch.Tensor  # [rank] f32
    k_b: torch.Tensor  # [H, rank, nope], activation dtype
    v_b: torch.Tensor  # [H, v, rank], activation dtype


@dataclass
class DeviceBlock:
    attn_norm: torch.Tensor  # [n_embd] f32
    # q/k/v/o: None on a Gated DeltaNet layer, which has `deltanet` instead
    wqkv: Linear | None  # [(n_head + 2 n_head_kv) * head_dim, n_embd]: q, k, v rows (and biases)
    q_norm: torch.Tensor | None  # olmoe [n_head * head_dim]; qwen3moe [head_dim]
    k_norm: torch.Tensor | None
    wo: Linear | None  # [n_embd, n_head * head_dim] (and its bias: gpt-oss)
    ffn_norm: torch.Tensor  # [n_embd] f32
    router: torch.Tensor | None  # [n_expert, n_embd] f32; None for a dense FFN layer
    experts: torch.Tensor | None  # expert tensor as the kernels take it (kernels.expert_formats)
    experts_fmt: str
    shared: GatedFFN | None
    shared_gate: torch.Tensor | None  # [n_embd] f32
    dense_ffn: GatedFFN | None
    # gpt-oss (None / 0 for the other families)
    sinks: torch.Tensor | None = None  # [n_head] f32 sink logits
    window: int = 0  # sliding-window attention: keys a query sees (0: all)
    router_bias: torch.Tensor | None = None  # [n_expert] f32
    expert_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # kernels.moe_args: by id
    # qwen35moe
    attn_gate: Linear | None = None  # [n_head * head_dim, n_embd]: out *= sigmoid(x Wg^T)
    deltanet: DeviceDeltaNet | None = None
    mla: DeviceMLA | None = None  # deepseek2 (with wo, its output; no wqkv)
    # llama4: attention within chunks of `chunk` tokens (0: none); a NoPE layer (no rope,
    # global attention, temperature-scaled queries)
    chunk: int = 0
    nope: bool = False


@dataclass
class DeviceWeights:
    # [n_vocab, n_embd]: Q8_0 (q, d) or float w, read by the lookup; None where an untied one
    # stays in host memory (the hybrid: pyruntime.offload.embedding)
    token_embd: Linear | None
    output_norm: torch.Tensor  # [n_embd] f32
    output: Linear  # lm_head [n_vocab, n_embd] (token_embd itself when tied)
    blocks: list[DeviceBlock]


def _bytes_on(raw: np.ndarray, device: torch.device) -> torch.Tensor:
    """The stored bytes of an mmap view as a flat uint8 tensor on `device` (one copy; in
    pieces where the view crosses the edge of a span an offloading executor registered for DMA:
    pyruntime.offload.host_register.dma_cuts)."""
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap; never written through
        src = torch.from_numpy(flat)
    cuts = dma_cuts(flat.ctypes.data, flat.nbytes)
    if not cuts:
        return src.to(device)
    out = torch.empty(flat.nbytes, dtype=torch.uint8, device=device)
    for a, b in itertools.pairwise([0, *cuts, flat.nbytes]):
        out[a:b].copy_(src[a:b])
    return out


def _format(name: str, qtype: Q) -> str:
    if qtype not in FORMAT_NAMES:
        raise UsageError(f"tensor '{name}': type {qtype.name} is not supported on the GPU")
    return FORMAT_NAMES[qtype]


def _row_chunks(m: QuantMatrix) -> Iterator[tuple[int, int, np.ndarray]]:
    """(first row, end row, their stored bytes uint8 [rows, row_bytes]) of m, in chunks of at
    most LOAD_CHUNK_ELEMENTS weights (one row at least)."""
    n_out, n_in = m.shape
    by_row = np.asarray(m.raw).reshape(-1).view(np.uint8).reshape(n_out, -1)
    step = max(1, LOAD_CHUNK_ELEMENTS // n_in)
    for r0 in range(0, n_out, step):
        r1 = min(r0 + step, n_out)
        yield r0, r1, by_row[r0:r1]


def upload_dense(m: QuantMatrix, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Matrix m on the device as `dtype`, shape m.shape: its bytes when the GGUF stores that
    dtype, else converted (a float cast or a block format dequantized) chunk by chunk."""
    fmt = _format(m.name, m.qtype)
    if FLOAT_DTYPES.get(fmt) == dtype:
        return _bytes_on(m.raw, device).view(dtype).reshape(m.shape)
    out = torch.empty(m.shape, dtype=dtype, device=device)
    for r0, r1, raw in _row_chunks(m):
        rows = _bytes_on(raw, device).reshape(r1 - r0, -1)
        if fmt in FLOAT_DTYPES:
            out[r0:r1].copy_(rows.view(FLOAT_DTYPES[fmt]))
        else:
            out[r0:r1].copy_(dequantize_rows(rows, fmt, m.shape[1]))
    return out


def upload_linear(m: QuantMatrix, device: torch.device, dtype: torch.dtype) -> Linear:
    """A matmul weight (or the token embedding): Q8_0 stays quantized (q, d), Q4_0 becomes the
    same weights as Q8_0 (exact), anything else becomes `dtype` (upload_dense)."""
    if m.qtype not in (Q.Q8_0, Q.Q4_0):
        return Linear(w=upload_dense(m, device, dtype))
    split = split_q8_0 if m.qtype == Q.Q8_0 else q4_0_as_q8_0
    n_out, n_in = m.shape
    q = torch.empty(n_out, n_in, dtype=torch.int8, device=device)
    d = torch.empty(n_out, n_in // 32, dtype=torch.float16, device=device)
    for r0, r1, raw in _row_chunks(m):
        q_rows, d_rows = split(_bytes_on(raw, device).reshape(r1 - r0, -1), n_in)
        q[r0:r1].copy_(q_rows)
        d[r0:r1].copy_(d_rows)
    return Linear(q=q, d=d)


def upload_experts(store: ExpertStore, device: torch.device) -> tuple[torch.Tensor, str]:
    """A layer's routed-expert tensor in its GGUF format on the device, as the kernels want it."""
    fmt = _format(store.name, store.qtype)
    raw = _bytes_on(store.raw, device)
    w = raw.view(FLOAT_DTYPES[fmt]) if fmt in FLOAT_DTYPES else raw
    w = w.reshape(store.n_expert, store.n_ff, 3, -1)  # [.., 3, n_embd or row_bytes]
    return prepare_experts(w, fmt, store.n_embd)


def _ffn(w: FFNWeights | None, device: torch.device, dtype: torch.dtype) -> GatedFFN | None:
    if w is None:
        return None
    gate, up = (upload_linear(m, device, dtype) for m in (w.gate, w.up))
    return GatedFFN(Linear.stack([gate, up]), upload_linear(w.down, device, dtype))


def upload_block(
    blk: BlockWeights, index: int, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
    routed_experts: bool = True,
) -> DeviceBlock:  # fmt: skip
    """Block `index` of the model on the device. routed_experts=False: a MoE block's `experts`
    stays None (a hybrid executor keeps them in slots of its own) and `experts_fmt` names the
    format its slots hold."""

    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=torch.float32).contiguous()

    deltanet = None if blk.deltanet is None else _deltanet(blk.deltanet, device, dtype, f32)
    mla = None if blk.mla is None else _mla(blk.mla, cfg, device, dtype, f32)
    if deltanet is not None:
        wqkv = wo = None
    elif mla is not None:
        wqkv, wo = None, upload_linear(blk.wo, device, dtype)
    else:
        wqkv, wo = _attention(blk, cfg, device, dtype)
    expert_bias = None
    if blk.experts is not None and blk.experts.bias is not None:
        expert_bias = tuple(f32(t).contiguous() for t in blk.experts.bias_pair)
    if blk.experts is None:
        experts, fmt = None, ""
    elif routed_experts:
        experts, fmt = upload_experts(blk.experts, device)
    else:
        experts, fmt = None, slot_format(blk.experts)
    return DeviceBlock(
        attn_norm=f32(blk.attn_norm),
        wqkv=wqkv,
        q_norm=f32(blk.q_norm),
        k_norm=f32(blk.k_norm),
        wo=wo,
        ffn_norm=f32(blk.ffn_norm),
        router=None if blk.router is None else upload_dense(blk.router, device, torch.float32),
        experts=experts,
        experts_fmt=fmt,
        shared=_ffn(blk.shared, device, dtype),
        shared_gate=f32(blk.shared_gate),
        dense_ffn=_ffn(blk.dense_ffn, device, dtype),
        sinks=f32(blk.sinks),
        window=cfg.layer_window(index),
        router_bias=f32(blk.router_bias),
        expert_bias=expert_bias,
        attn_gate=None if blk.attn_gate is None else upload_linear(blk.attn_gate, device, dtype),
        deltanet=deltanet,
        mla=mla,
        chunk=cfg.layer_chunk(index),
        nope=cfg.is_nope(index),
    )


def _attention(blk: BlockWeights, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """(wqkv, wo) of an attention layer: q, k, v stacked, their biases and o's."""
    wqkv = Linear.stack([upload_linear(m, device, dtype) for m in (blk.wq, blk.wk, blk.wv)])
    biases = (blk.bq, blk.bk, blk.bv)
    if any(b is not None for b in biases):
        rows = (cfg.n_head, cfg.n_head_kv, cfg.n_head_kv)
        biases = [b if b is not None else torch.zeros(r * cfg.head_dim)
                  for b, r in zip(biases, rows, strict=True)]  # fmt: skip
        wqkv.bias = torch.cat(biases).to(device=device, dtype=dtype)
    wo = upload_linear(blk.wo, device, dtype)
    if blk.bo is not None:
        wo.bias = blk.bo.to(device=device, dtype=dtype)
    return wqkv, wo


def _deltanet(w: DeltaNetWeights, device: torch.device, dtype: torch.dtype, f32):
    parts = [upload_linear(m, device, dtype) for m in (w.qkv, w.gate, w.beta, w.alpha)]
    return DeviceDeltaNet(
        in_proj=Linear.stack(parts), conv=f32(w.conv), a=f32(w.a), dt_bias=f32(w.dt_bias),
        norm=f32(w.norm), out=upload_linear(w.out, device, dtype),
    )  # fmt: skip


def _mla(w: MLAWeights, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, f32):
    def lin(m: QuantMatrix | None) -> Linear | None:
        return None if m is None else upload_linear(m, device, dtype)

    H, rank = cfg.n_head, cfg.mla_kv_rank
    return DeviceMLA(
        q=lin(w.q), q_a=lin(w.q_a), q_a_norm=f32(w.q_a_norm), q_b=lin(w.q_b),
        kv_a=lin(w.kv_a), kv_a_norm=f32(w.kv_a_norm),
        k_b=upload_dense(w.k_b, device, dtype).view(H, rank, cfg.mla_nope_dim),
        v_b=upload_dense(w.v_b, device, dtype).view(H, cfg.mla_v_dim, rank),
    )  # fmt: skip


def slot_format(store: ExpertStore) -> str:
    """The format a layer's experts take on the device (upload_experts): q8_0 / q4_0 / mxfp4
    repacked (kernels.expert_formats.REPACKED)."""
    fmt = _format(store.name, store.qtype)
    return REPACKED.get(fmt, fmt)


def upload_weights(
    host: HostWeights, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
    routed_experts: bool = True, token_embd: bool = True,
) -> DeviceWeights:  # fmt: skip
    """Every weight on the device; routed_experts=False leaves the routed experts on the host
    (upload_block), token_embd=False an untied token embedding (a tied one is the lm_head: it
    is uploaded all the same)."""
    tied = host.output is host.token_embd
    embd = upload_linear(host.token_embd, device, dtype) if token_embd or tied else None
    output = embd if tied else upload_linear(host.output, device, dtype)
    return DeviceWeights(
        token_embd=embd,
        output_norm=host.output_norm.to(device=device, dtype=torch.float32),
        output=output,
        blocks=[
            upload_block(b, i, cfg, device, dtype, routed_experts)
            for i, b in enumerate(host.blocks)
        ],  # fmt: skip
    )


def first_matrix_type(host: HostWeights) -> Q:
    """The type of the first layer's first projection (attention q, a DeltaNet's qkv, MLA's
    kv_a): what the GGUF's dense weights are (dense_dtype_for)."""
    blk = host.blocks[0]
    if blk.mla is not None:
        return blk.mla.kv_a.qtype
    return (blk.wq if blk.wq is not None else blk.deltanet.qkv).qtype


def dense_dtype_for(attn_q_type: Q) -> torch.dtype:
    """Activation and float-weight dtype from the type of the attention q weight: float32 when
    the GGUF's dense weights are F32 (exact parity with the CPU path), else bfloat16 (Q8_0
    matmul weights stay Q8_0, see Linear)."""
    return torch.float32 if attn_q_type == Q.F32 else torch.bfloat16
