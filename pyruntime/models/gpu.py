"""The whole MoE decoder on one torch device (the GPU; also runs on the CPU for tests).

Same math as pyruntime.models.transformer (the CPU reference), laid out for a GPU:
- dense weights (attention, norms, routers, shared experts, dense FFN layers, embeddings) live
  on the device: float32 when the GGUF stores them in F32 (so logits match the CPU path), else
  bfloat16 (dequantized once at load, on the device);
- routed experts stay in their GGUF format on the device (kernels.dispatch.prepare_experts) and
  run in the Triton kernels (dense, or neuron-sparse under a per-layer threshold);
- a static KV cache [n_layer, 2, n_head_kv, max_tokens, head_dim] on the device;
- prefill (n > 1 tokens) runs eagerly with torch SDPA; decode (1 token) is one step whose inputs
  (token id, position, cached length) are device tensors, with the split-K decode attention
  kernel (kernels.attention), so on CUDA the step is captured once per cache in a CUDA graph and
  replayed for every token. On the CPU the same step runs eagerly (Triton interpreter).

The residual stream is float32 whatever the weight dtype; norm outputs are cast to the weight
dtype for the matmuls; routers and the shared-expert gate run in float32 (they are F32 in the GGUF).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from kernels.attention import decode_attention
from kernels.decoder_ops import add_rms_norm, qk_rope_store
from kernels.dispatch import moe_experts, prepare_experts
from kernels.expert_formats import ACTIVATIONS as KERNEL_ACTIVATIONS
from kernels.expert_formats import dequantize_rows
from kernels.q8_linear import dequantize_q8, q8_gemv, split_q8_0
from kernels.router import router_topk
from pyruntime.errors import UsageError
from pyruntime.experts.compute import activation_fn
from pyruntime.gguf_file import GGUFFile, TensorView
from pyruntime.models.config import ModelConfig
from pyruntime.models.transformer import rope_tables

Q = GGMLQuantizationType
FORMATS = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q8_0: "q8_0", Q.Q4_0: "q4_0"}
# The largest batch the sparse expert path runs at; above it the dense kernel runs even with a
# threshold. A constant until kernels/switch.py (the profiled switch) is available.
SPARSE_MAX_BATCH = 16

# ---------------------------------------------------------------------------------------------
# Loading weights onto the device


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.w is not None:
            return F.linear(x, self.w, self.bias)
        if x.shape[0] <= Q8_GEMV_MAX_TOKENS:
            return q8_gemv(x.contiguous(), self.q, self.d, self.bias)
        return F.linear(x, dequantize_q8(self.q, self.d, x.dtype), self.bias)

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


class _Loader:
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


# ---------------------------------------------------------------------------------------------
# KV cache and the decode step's static inputs


class DeviceKVCache:
    """Static KV cache on the device: kv [n_layer, 2, n_head_kv, max_tokens, head_dim].

    Also holds the decode step's inputs as device tensors (token [1], position [1], cached
    length [1]) and the rope tables for every position, so a captured decode graph reads all its
    inputs from fixed addresses. `graph` is the captured decode step of this cache (CUDA only).
    """

    def __init__(self, cfg: ModelConfig, max_tokens: int, device: torch.device, dtype) -> None:
        if max_tokens < 1:
            raise UsageError(f"context size must be at least 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.n_tokens = 0
        shape = (cfg.n_layer, 2, cfg.n_head_kv, max_tokens, cfg.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        cos, sin = rope_tables(torch.arange(max_tokens), cfg.rope_dim, cfg.rope_theta)
        self.cos, self.sin = cos.to(device), sin.to(device)  # [max_tokens, rope_dim] f32
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.seq_len = torch.ones(1, dtype=torch.int32, device=device)  # position + 1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None  # the captured step's output [1, n_vocab]
        self.graph_key: object = None  # model state the graph was captured under

    def truncate(self, n: int) -> None:
        """Forget positions >= n (keeps a common prefix for reuse)."""
        self.n_tokens = max(0, min(n, self.n_tokens))

    def reserve(self, n_new: int) -> None:
        if self.n_tokens + n_new > self.max_tokens:
            raise UsageError(
                f"context is full: {self.n_tokens} tokens cached + {n_new} new > context size "
                f"{self.max_tokens} (raise --ctx-size / n_ctx, or start a new conversation)"
            )


class DeviceExpertStats:
    """Routed-expert work counts, with the active-neuron count kept on the device (no sync per
    layer; a captured graph adds to it on every replay). Same interface as ExpertStats."""

    def __init__(self, device: torch.device) -> None:
        self._active = torch.zeros((), dtype=torch.int64, device=device)
        self.pairs = 0  # (token, expert) computations
        self.neurons = 0  # pairs * n_ff
        self._dense_active = 0  # neurons of pairs that ran dense (all active)

    def add_dense(self, n_pairs: int, n_ff: int) -> None:
        self.pairs += n_pairs
        self.neurons += n_pairs * n_ff
        self._dense_active += n_pairs * n_ff

    def add_sparse(self, n_pairs: int, n_ff: int) -> None:
        """Host counts of a sparse call; its active counts went to `accumulate` (device)."""
        self.pairs += n_pairs
        self.neurons += n_pairs * n_ff

    def accumulate(self, active: torch.Tensor) -> None:
        self._active.add_(active.sum())

    @property
    def active(self) -> int:
        return self._dense_active + int(self._active)

    @property
    def sparsity(self) -> float:
        return 0.0 if self.neurons == 0 else 1.0 - self.active / self.neurons

    def reset(self) -> None:
        self._active.zero_()
        self.pairs = self.neurons = self._dense_active = 0


# ---------------------------------------------------------------------------------------------
# The model


class DeviceTransformer:
    """Forward pass on `device` with a static KV cache; `forward` returns float32 logits
    [n_tokens, n_vocab] on the CPU (the sampler's side)."""

    def __init__(self, cfg: ModelConfig, f: GGUFFile, device: str | torch.device = "cuda") -> None:
        self.config = cfg
        self.device = torch.device(device)
        if cfg.activation not in KERNEL_ACTIVATIONS:
            raise UsageError(
                f"expert activation '{cfg.activation}' has no GPU kernel (GPU: "
                f"{', '.join(KERNEL_ACTIVATIONS)}); use --device cpu"
            )
        self.dtype = dense_dtype_for(f)
        load = _Loader(f, self.device, self.dtype)
        self.token_embd = load.dense("token_embd.weight")  # [n_vocab, n_embd], for the lookup
        self.output_norm = load.dense("output_norm.weight", torch.float32)
        tied = not f.has_tensor("output.weight")
        self.output = load.linear("token_embd.weight" if tied else "output.weight")  # lm_head
        if tied and self.output.w is not None:
            self.output = Linear(w=self.token_embd)  # share the float copy
        self.blocks = [load.block(cfg, i) for i in range(cfg.n_layer)]
        self.act = activation_fn(cfg.activation)
        self.scale = (
            cfg.attention_scale if cfg.attention_scale is not None else 1 / math.sqrt(cfg.head_dim)
        )
        self.expert_threshold: list[torch.Tensor] | None = None  # per layer, [1] f32 each
        self.sparse_max_batch = [SPARSE_MAX_BATCH] * cfg.n_layer  # per layer (kernels.switch)
        self.stats = DeviceExpertStats(self.device)
        self.use_cuda_graph = self.device.type == "cuda" and os.environ.get(
            "PYRUNTIME_CUDA_GRAPH", "1"
        ) not in ("0", "")
        self._state_version = 0  # bumped when a captured graph would be stale
        self.profile_parts = False  # label the parts of a step for torch.profiler

    # -- public -------------------------------------------------------------------------------

    def new_cache(self, max_tokens: int) -> DeviceKVCache:
        return DeviceKVCache(self.config, max_tokens, self.device, self.dtype)

    def set_expert_threshold(self, thresholds: Sequence[float] | None, key: str = "") -> None:
        """Per-layer |act(gate)| thresholds (None = dense). On CUDA with a `key` (the model's
        identity and sparsity), each layer's dense/sparse switch batch comes from
        kernels.switch (profiled once per GPU and layer, cached); else SPARSE_MAX_BATCH."""
        n_layer = self.config.n_layer
        self.sparse_max_batch = [SPARSE_MAX_BATCH] * n_layer
        if thresholds is None:
            self.expert_threshold = None
        else:
            self.expert_threshold = [
                torch.tensor([float(t)], device=self.device) for t in thresholds
            ]
            if self.device.type == "cuda" and key:
                self.sparse_max_batch = self._profiled_switch(key)
        self._state_version += 1

    def _profiled_switch(self, key: str) -> list[int]:
        from kernels.switch import sparse_max_batch

        cfg = self.config
        out = []
        for i, blk in enumerate(self.blocks):
            if blk.experts is None:
                out.append(0)
                continue
            out.append(
                sparse_max_batch(
                    blk.experts,
                    blk.experts_fmt,
                    cfg.n_embd,
                    cfg.n_expert_used,
                    cfg.activation,
                    self.expert_threshold[i],
                    key=f"{key}/layer{i}",
                )  # fmt: skip
            )
        return out

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[int] | torch.Tensor, cache: DeviceKVCache, last_only: bool = False
    ) -> torch.Tensor:
        cfg = self.config
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise UsageError("forward() needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.n_vocab:
            raise UsageError(f"token id out of range [0, {cfg.n_vocab})")
        cache.reserve(n)
        if n == 1:
            logits = self._decode(int(ids[0]), cache)
        else:
            logits = self._prefill(ids.to(self.device), cache, last_only)
        cache.n_tokens += n
        return logits.float().cpu()

    # -- the layers (shared by prefill and decode) --------------------------------------------

    def _run(self, x: torch.Tensor, cache: DeviceKVCache, positions: torch.Tensor, attend):
        """x [n, n_embd] f32 embeddings at `positions` [n] (device) -> final hidden state h
        [n, n_embd] (normed, matmul dtype). attend(q [n_head, n, D], kv) -> [n, n_head * D]."""
        cfg = self.config
        eps, alpha = cfg.rms_eps, cfg.residual_scale
        split_f32 = self.dtype != torch.float32  # the router wants f32 inputs
        delta = None  # the previous sub-block's output, added to x by the next norm
        for i, blk in enumerate(self.blocks):
            with self._part("norm"):
                h, _ = add_rms_norm(x, delta, blk.attn_norm, eps, self.dtype, alpha)
            with self._part("qkv"):
                qkv = blk.wqkv(h)
            with self._part("rope+kv store"):
                kv = cache.kv[i]  # [2, n_head_kv, max_tokens, head_dim]
                q = qk_rope_store(
                    qkv, kv, positions, cache.cos, cache.sin, cfg.n_head,
                    blk.q_norm, blk.k_norm, eps, cfg.clamp_kqv,
                )  # fmt: skip
            with self._part("attention"):
                a = attend(q, kv)
            with self._part("o_proj"):
                delta = blk.wo(a)
            with self._part("norm"):
                h, h32 = add_rms_norm(x, delta, blk.ffn_norm, eps, self.dtype, alpha, split_f32)
            delta = self._ffn(i, blk, h, h if h32 is None else h32)
        with self._part("norm"):
            h, _ = add_rms_norm(x, delta, self.output_norm, eps, self.dtype, alpha)
        return h

    def _ffn(self, i: int, blk: DeviceBlock, h: torch.Tensor, h32: torch.Tensor) -> torch.Tensor:
        """The FFN sub-block's output [n, n_embd] (before the residual scale)."""
        cfg = self.config
        if blk.experts is None:
            with self._part("dense ffn"):
                return self._gated_ffn(blk.dense_ffn, h)
        with self._part("router"):
            logits = h32 @ blk.router.T  # [n, n_expert] f32
            ids, w = router_topk(logits, cfg.n_expert_used, cfg.expert_weights_norm)
        with self._part("routed experts"):
            threshold = None if self.expert_threshold is None else self.expert_threshold[i]
            y, active = moe_experts(
                h, blk.experts, blk.experts_fmt, ids, w, cfg.activation,
                threshold=threshold, sparse_max_batch=self.sparse_max_batch[i],
            )  # fmt: skip
            if h.shape[0] > 1:  # prefill counts here (decode: _count_decode_experts)
                add = self.stats.add_dense if active is None else self.stats.add_sparse
                add(ids.numel(), cfg.n_ff_exp)
            if active is not None:
                self.stats.accumulate(active)
        if blk.shared is not None:
            with self._part("shared expert"):
                s = self._gated_ffn(blk.shared, h).float()
                if blk.shared_gate is not None:
                    s = s * torch.sigmoid(h32 @ blk.shared_gate)[:, None]
                y = y + s
        return y

    def _gated_ffn(self, w: GatedFFN, x: torch.Tensor) -> torch.Tensor:
        g, u = w.gate_up(x).chunk(2, dim=-1)
        return w.down((self.act(g) * u).to(x.dtype))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        with self._part("lm_head"):
            return self.output(h).float() / self.config.logit_scale

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embd.index_select(0, ids).float()  # [n, n_embd], a new tensor
        return x * self.config.embedding_scale if self.config.embedding_scale != 1.0 else x

    def _part(self, name: str):
        """A profiler range around one part of a layer (bench/gpu_decode.py), else nothing."""
        if self.profile_parts:
            return torch.profiler.record_function(name)
        return contextlib.nullcontext()

    # -- prefill (eager) ----------------------------------------------------------------------

    def _prefill(self, ids: torch.Tensor, cache: DeviceKVCache, last_only: bool) -> torch.Tensor:
        start, n = cache.n_tokens, ids.numel()
        positions = torch.arange(start, start + n, device=self.device)

        def attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return self._prefill_attention(q, kv[0, :, : start + n], kv[1, :, : start + n], start)

        h = self._run(self._embed(ids), cache, positions, attend)
        return self._logits(h[-1:] if last_only else h)

    def _prefill_attention(self, q, keys, values, start: int) -> torch.Tensor:
        """q [n_head, n, D]; keys, values [n_head_kv, start + n, D] -> [n, n_head * D]."""
        cfg = self.config
        n, end = q.shape[1], keys.shape[1]
        group = cfg.n_head // cfg.n_head_kv
        if group > 1:
            keys = keys.repeat_interleave(group, dim=0)
            values = values.repeat_interleave(group, dim=0)
        # Causal over absolute positions: query at start+a sees keys 0..start+a.
        q_pos = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= q_pos  # [n, end]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1).reshape(n, cfg.n_head * cfg.head_dim)

    # -- decode (one token; graph-capturable) -------------------------------------------------

    def _decode(self, token: int, cache: DeviceKVCache) -> torch.Tensor:
        """Logits [1, n_vocab] of one token at position cache.n_tokens."""
        cache.token.fill_(token)
        cache.position.fill_(cache.n_tokens)
        cache.seq_len.fill_(cache.n_tokens + 1)
        self._count_decode_experts()
        if not self.use_cuda_graph:
            return self._decode_step(cache)
        if cache.graph is None or cache.graph_key != self._state_version:
            self._capture(cache)
            cache.graph_key = self._state_version
        cache.graph.replay()
        return cache.graph_logits

    def _capture(self, cache: DeviceKVCache) -> None:
        """Capture the decode step on `cache` (its buffers hold the current step's inputs).

        Warm-up on a side stream first (Triton compiles outside the capture); the warm-up
        writes this step's K/V and active count, which the replay redoes (same values), so the
        active count is taken back to what it was."""
        saved = self.stats._active.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._decode_step(cache)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.graph_logits = self._decode_step(cache)
        self.stats._active.copy_(saved)
        cache.graph = graph

    def _decode_step(self, cache: DeviceKVCache) -> torch.Tensor:
        """Reads cache.token / position / seq_len; no host sync. Returns logits [1, n_vocab]."""

        def attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            out = decode_attention(q[:, 0], kv[0], kv[1], cache.seq_len, self.scale)
            return out.reshape(1, -1)  # [1, n_head * D]

        h = self._run(self._embed(cache.token), cache, cache.position, attend)
        return self._logits(h)

    def _count_decode_experts(self) -> None:
        """Host-side counts of one decode step's routed work (replays cannot run Python)."""
        n_ff, k = self.config.n_ff_exp, self.config.n_expert_used
        for i, blk in enumerate(self.blocks):
            if blk.experts is not None:
                sparse = self.expert_threshold is not None and self.sparse_max_batch[i] >= 1
                (self.stats.add_sparse if sparse else self.stats.add_dense)(k, n_ff)
