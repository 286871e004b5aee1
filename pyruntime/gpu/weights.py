"""Weights of the device model (pyruntime.gpu.executor): uploaded from the GGUF mmap once.

- routed experts: their GGUF bytes on the device, prepared by kernels.dispatch.prepare_experts
  (never dequantized);
- matmul weights (attention, shared experts, dense FFN layers, lm_head): `Linear`, Q8_0 kept
  quantized (kernels.q8_linear) when the GGUF stores Q8_0, else float (f32 for an F32 GGUF,
  bf16 otherwise);
- norms, routers, the shared-expert gate: float32 (F32 in the GGUF); embeddings: float copy.
Also the device memory estimate used by `--device auto`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pyruntime.errors import UsageError
from pyruntime.gguf.file import GGUFFile, TensorView
from pyruntime.kernels.dispatch import prepare_experts
from pyruntime.kernels.expert_formats import dequantize_rows
from pyruntime.kernels.q8_linear import dequantize_q8, q8_gemv, split_q8_0
from pyruntime.model.config import ModelConfig

Q = GGMLQuantizationType
FORMATS = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q8_0: "q8_0", Q.Q4_0: "q4_0"}


def _raw_bytes(t: TensorView, device: torch.device) -> torch.Tensor:
    """The stored bytes of `t` as a flat uint8 tensor on `device` (one copy from the mmap)."""
    flat = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap; never written through
        return torch.from_numpy(flat).to(device)


def upload_dense(t: TensorView, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `t` dequantized on the device to `dtype`, shape t.shape."""
    if t.qtype not in FORMATS:
        raise UsageError(f"tensor '{t.name}': type {t.qtype.name} is not supported on the GPU")
    fmt = FORMATS[t.qtype]
    raw = _raw_bytes(t, device)
    if fmt in ("f32", "f16", "bf16"):
        w = raw.view({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[fmt])
        return w.reshape(t.shape).to(dtype)
    rows = raw.reshape(*t.shape[:-1], -1)
    return dequantize_rows(rows, fmt, t.shape[-1]).to(dtype)


def upload_experts(t: TensorView, device: torch.device, n_embd: int) -> tuple[torch.Tensor, str]:
    """The routed-expert tensor in its GGUF format on the device, as the kernels want it."""
    if t.qtype not in FORMATS:
        raise UsageError(f"tensor '{t.name}': type {t.qtype.name} is not supported on the GPU")
    fmt = FORMATS[t.qtype]
    raw = _raw_bytes(t, device)
    if fmt == "f32":
        w = raw.view(torch.float32)
    elif fmt in ("f16", "bf16"):
        w = raw.view(torch.float16 if fmt == "f16" else torch.bfloat16)
    else:
        w = raw
    w = w.reshape(*t.shape[:-1], -1)  # [n_expert, n_ff, 3, n_embd or row_bytes]
    return prepare_experts(w, fmt, n_embd)


# Decode (T <= this) reads Q8_0 dense weights with the GEMV kernel; prefill dequantizes per call.
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
class DeviceBlock:
    attn_norm: torch.Tensor  # [n_embd] f32
    wqkv: Linear  # [(n_head + 2 n_head_kv) * head_dim, n_embd]: q, k, v rows (and biases)
    q_norm: torch.Tensor | None  # olmoe [n_head * head_dim]; qwen3moe [head_dim]
    k_norm: torch.Tensor | None
    wo: Linear  # [n_embd, n_head * head_dim]
    ffn_norm: torch.Tensor  # [n_embd] f32
    router: torch.Tensor | None  # [n_expert, n_embd] f32; None for a dense FFN layer
    experts: torch.Tensor | None  # GGUF-format expert tensor (kernels.expert_formats)
    experts_fmt: str
    shared: GatedFFN | None
    shared_gate: torch.Tensor | None  # [n_embd] f32
    dense_ffn: GatedFFN | None


class WeightLoader:
    """Uploads one GGUF's tensors to `device` in the forms above."""

    def __init__(self, f: GGUFFile, device: torch.device, dtype: torch.dtype) -> None:
        self.f, self.device, self.dtype = f, device, dtype
        self.q8 = os.environ.get("PYRUNTIME_DENSE_Q8", "1") not in ("0", "")

    def linear(self, name: str) -> Linear:
        """A matmul weight: Q8_0 stays quantized (PYRUNTIME_DENSE_Q8=0: bf16 instead)."""
        t = self.f.tensor(name)
        if t.qtype == Q.Q8_0 and self.q8:
            q, d = split_q8_0(_raw_bytes(t, self.device).reshape(t.shape[0], -1), t.shape[1])
            return Linear(q=q, d=d)
        return Linear(w=upload_dense(t, self.device, self.dtype))

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return upload_dense(self.f.tensor(name), self.device, dtype or self.dtype)

    def opt(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.dense(name, dtype) if self.f.has_tensor(name) else None

    def ffn(self, prefix: str, suffix: str) -> GatedFFN | None:
        if not self.f.has_tensor(f"{prefix}.ffn_gate{suffix}.weight"):
            return None
        gate = self.linear(f"{prefix}.ffn_gate{suffix}.weight")
        up = self.linear(f"{prefix}.ffn_up{suffix}.weight")
        return GatedFFN(Linear.stack([gate, up]), self.linear(f"{prefix}.ffn_down{suffix}.weight"))

    def block(self, cfg: ModelConfig, i: int) -> DeviceBlock:
        p, f32 = f"blk.{i}", torch.float32
        wqkv = Linear.stack([self.linear(f"{p}.attn_{s}.weight") for s in "qkv"])
        biases = [self.opt(f"{p}.attn_{s}.bias") for s in "qkv"]
        if any(b is not None for b in biases):
            rows = [cfg.n_head, cfg.n_head_kv, cfg.n_head_kv]
            biases = [
                b if b is not None else torch.zeros(r * cfg.head_dim, device=self.device)
                for b, r in zip(biases, rows, strict=True)
            ]
            wqkv.bias = torch.cat(biases).to(self.dtype)
        has_experts = self.f.has_tensor(f"{p}.ffn_gud_exps.weight")
        experts, fmt = (None, "")
        if has_experts:
            experts, fmt = upload_experts(
                self.f.tensor(f"{p}.ffn_gud_exps.weight"), self.device, cfg.n_embd
            )
        shared_gate = self.opt(f"{p}.ffn_gate_inp_shexp.weight", f32)
        return DeviceBlock(
            attn_norm=self.dense(f"{p}.attn_norm.weight", f32),
            wqkv=wqkv,
            q_norm=self.opt(f"{p}.attn_q_norm.weight", f32),
            k_norm=self.opt(f"{p}.attn_k_norm.weight", f32),
            wo=self.linear(f"{p}.attn_output.weight"),
            ffn_norm=self.dense(f"{p}.ffn_norm.weight", f32),
            router=self.dense(f"{p}.ffn_gate_inp.weight", f32) if has_experts else None,
            experts=experts,
            experts_fmt=fmt,
            shared=self.ffn(p, "_shexp"),
            shared_gate=None if shared_gate is None else shared_gate.reshape(-1),
            dense_ffn=None if has_experts else self.ffn(p, ""),
        )


def dense_dtype_for(f: GGUFFile) -> torch.dtype:
    """Activation and float-weight dtype: float32 when the GGUF's dense weights are F32 (exact
    parity with the CPU path), else bfloat16 (Q8_0 matmul weights stay Q8_0, see Linear)."""
    return torch.float32 if f.tensor("blk.0.attn_q.weight").qtype == Q.F32 else torch.bfloat16


def device_bytes(f: GGUFFile, cfg: ModelConfig, n_ctx: int) -> int:
    """Bytes the model needs on the device: weights as uploaded + KV cache + activations."""
    dtype = dense_dtype_for(f)
    total = 0
    for t in f.tensors.values():
        if t.name.endswith("ffn_gud_exps.weight") or (t.qtype == Q.Q8_0 and t.data.ndim > 1):
            total += t.n_bytes  # kept in the GGUF format
        elif t.qtype == Q.F32 or t.data.ndim == 1:
            total += t.n_elements * 4
        else:
            total += t.n_elements * dtype.itemsize
    # token_embd twice: a float copy for the lookup and the lm_head (tied) or its Q8_0 bytes
    total += f.tensor("token_embd.weight").n_elements * dtype.itemsize
    total += kv_cache_bytes(cfg, n_ctx, dtype)
    # Working memory: the largest transient (dequantizing one tensor in f32 at load) and the
    # prefill activations; 256 MiB covers the models we run plus the CUDA context's own needs.
    biggest = max(t.n_elements for t in f.tensors.values()) * 4
    return total + biggest + (256 << 20)


def kv_cache_bytes(cfg: ModelConfig, n_ctx: int, dtype: torch.dtype) -> int:
    return cfg.n_layer * 2 * cfg.n_head_kv * n_ctx * cfg.head_dim * dtype.itemsize
