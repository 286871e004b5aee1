"""The whole MoE decoder on one torch device (the GPU; also runs on the CPU for tests).

Same math as pyruntime.model.reference (the reference), laid out for a GPU:
- weights on the device (pyruntime.gpu.weights): routed experts in their GGUF format
  (kernels.dispatch, dense or neuron-sparse under a per-layer threshold), Q8_0 matmul weights
  kept Q8_0 (kernels.q8_linear), other dense weights float32 for an F32 GGUF (so logits match
  the CPU path) else bfloat16;
- a static KV cache [n_layer, 2, n_head_kv, max_tokens, head_dim] on the device;
- prefill (n > 1 tokens) runs eagerly with torch SDPA; decode (1 token) is one step whose inputs
  (token id, position, cached length) are device tensors, with the split-K decode attention
  kernel (kernels.attention), so on CUDA the step is captured once per cache in a CUDA graph and
  replayed for every token. On the CPU the same step runs eagerly (Triton interpreter).

The residual stream is float32 whatever the weight dtype; norm outputs are cast to the
activation dtype (f32 or bf16) for the matmuls; routers and the shared-expert gate run in float32
(they are F32 in the GGUF). Per layer, a decode step is 6 launches plus the experts':
residual add + RMSNorm, qkv GEMV (or both in one launch with FUSE_NORM_GEMV, off: slower on an
H100), q/k-norm+rope+KV-store, attention (one launch, kernels.grid_sync merges its splits),
o_proj, and one launch for the residual add + RMSNorm + router GEMV + softmax + top-k.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pyruntime.errors import UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.gpu.weights import (
    DeviceBlock,
    GatedFFN,
    Linear,
    WeightLoader,
    dense_dtype_for,
)
from pyruntime.kernels import tuning
from pyruntime.kernels.attention import decode_attention
from pyruntime.kernels.decoder_ops import add_rms_norm, qk_rope_store
from pyruntime.kernels.dispatch import moe_experts
from pyruntime.kernels.expert_formats import ACT_CODES
from pyruntime.kernels.q8_linear import add_norm_q8_gemv
from pyruntime.kernels.router import add_norm_router, router_topk
from pyruntime.kernels.switch import SparseSwitch, sparse_switch
from pyruntime.kernels.tuning import lookup
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import activation_fn, rope_tables
from pyruntime.model.tokens import single_token, token_ids

# The batches the sparse expert path runs at when no profiled switch is available (the CPU
# interpreter, or no model key): up to 16 tokens; on CUDA each layer's comes from
# pyruntime.kernels.switch.
DEFAULT_SWITCH = SparseSwitch.up_to(16)
# Up to this many tokens (decode) a step runs the fused launches: the residual add + RMSNorm in
# the qkv Q8_0 GEMV's prologue (FUSE_NORM_GEMV) and in the router's launch (add_norm_router).
# PYRUNTIME_FUSED_DECODE=0 turns both off (the separate launches, for comparisons).
FUSED_MAX_TOKENS = 4 if os.environ.get("PYRUNTIME_FUSED_DECODE", "1") not in ("0", "") else 0
# PYRUNTIME_FUSE_NORM_GEMV=0/1 forces the first; else the kernels.tuning file's choice, else
# FUSE_NORM_GEMV: off, since on an H100 the norm-folded qkv GEMV took 12.2 µs a layer against
# 11.5 µs for the norm launch + the GEMV (bench/gpu_kernels.py: every program re-reads the three
# K-float vectors from L2).
FUSE_NORM_GEMV = False
FUSE_NORM_GEMV_ENV = os.environ.get("PYRUNTIME_FUSE_NORM_GEMV")


def fuse_norm_gemv() -> bool:
    if FUSE_NORM_GEMV_ENV is not None:
        return FUSE_NORM_GEMV_ENV not in ("0", "")
    tuned = lookup("fuse_norm_gemv")
    return FUSE_NORM_GEMV if tuned is None else bool(tuned)


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
        # The step's inputs (token, position, position + 1 = cached length after it) in one
        # device tensor, written by one host-to-device copy from a pinned staging tensor.
        self.step_inputs = torch.zeros(3, dtype=torch.long, device=device)
        self.token, self.position, self.seq_len = self.step_inputs.view(3, 1).unbind(0)
        pin = self.step_inputs.is_cuda
        self._staging = torch.zeros(3, dtype=torch.long, pin_memory=pin)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None  # the captured step's output [1, n_vocab]
        self.graph_key: object = None  # model state the graph was captured under

    def set_step(self, token: int) -> None:
        """The next decode step's inputs: `token` at position n_tokens. Asynchronous: the
        staging tensor is rewritten only after the previous step's logits reached the host
        (forward() waits for them), so its copy has run by then."""
        self._staging.numpy()[:] = (token, self.n_tokens, self.n_tokens + 1)
        self.step_inputs.copy_(self._staging, non_blocking=True)

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
        self._pending: list[torch.Tensor] = []  # this forward's per-layer active counts
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
        """Keep a layer's counts until `flush` (the end of the forward): summing each layer's
        on its own took two launches per layer (16 layers: ~50 us of a ~1 ms decode step)."""
        self._pending.append(active)

    def flush(self) -> None:
        """Add the pending layers' counts in three launches (cat, sum, add)."""
        if self._pending:
            self._active.add_(torch.cat([a.reshape(-1) for a in self._pending]).sum())
            self._pending.clear()

    @property
    def active(self) -> int:
        self.flush()
        return self._dense_active + int(self._active)

    @property
    def sparsity(self) -> float:
        return 0.0 if self.neurons == 0 else 1.0 - self.active / self.neurons

    def reset(self) -> None:
        self._pending.clear()
        self._active.zero_()
        self.pairs = self.neurons = self._dense_active = 0


# ---------------------------------------------------------------------------------------------
# The model


class GpuExecutor:
    """Forward pass on `device` with a static KV cache; `forward` returns float32 logits
    [n_tokens, n_vocab] on the CPU (the sampler's side)."""

    def __init__(self, cfg: ModelConfig, f: GGUFFile, device: str | torch.device = "cuda",
                 kernel_tuning: str | Path | None = None) -> None:  # fmt: skip
        self.config = cfg
        self.device = torch.device(device)
        if cfg.activation not in ACT_CODES:
            raise UsageError(
                f"expert activation '{cfg.activation}' has no GPU kernel (GPU: "
                f"{', '.join(ACT_CODES)}); use --device cpu"
            )
        try:  # a bad tuning file: one line now, not a traceback mid-decode
            tuning.set_overrides(None if kernel_tuning is None else tuning.load(kernel_tuning))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.dtype = dense_dtype_for(f)
        load = WeightLoader(f, self.device, self.dtype)
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
        self.sparse_switch = [DEFAULT_SWITCH] * cfg.n_layer  # per layer (kernels.switch)
        self.stats = DeviceExpertStats(self.device)
        self.use_cuda_graph = self.device.type == "cuda" and os.environ.get(
            "PYRUNTIME_CUDA_GRAPH", "1"
        ) not in ("0", "")
        self._state_version = 0  # bumped when a captured graph would be stale
        self._decode_counts = (-1, 0, 0)  # (state version, dense pairs, sparse pairs) per step
        self.profile_parts = False  # label the parts of a step for torch.profiler

    # -- public -------------------------------------------------------------------------------

    def new_cache(self, max_tokens: int) -> DeviceKVCache:
        return DeviceKVCache(self.config, max_tokens, self.device, self.dtype)

    def set_expert_threshold(self, thresholds: Sequence[float] | None, key: str = "",
                             cache_dir: Path | None = None) -> None:  # fmt: skip
        """Per-layer |act(gate)| thresholds (None = dense). On CUDA with a `key` (the model's
        identity and sparsity), each layer's dense/sparse switch comes from pyruntime.kernels.switch
        (profiled once per GPU and layer, cached in cache_dir, default the switch's); else
        DEFAULT_SWITCH."""
        n_layer = self.config.n_layer
        self.sparse_switch = [DEFAULT_SWITCH] * n_layer
        if thresholds is None:
            self.expert_threshold = None
        else:
            self.expert_threshold = [
                torch.tensor([float(t)], device=self.device) for t in thresholds
            ]
            if self.device.type == "cuda" and key:
                self.sparse_switch = self._profiled_switch(key, cache_dir)
        self._state_version += 1

    def _profiled_switch(self, key: str, cache_dir: Path | None = None) -> list[SparseSwitch]:
        cfg = self.config
        out = []
        told = False

        def tell(path) -> None:  # once per load, before the first layer is profiled
            nonlocal told
            if not told:
                told = True
                print(f"pyruntime: timing dense vs sparse experts per layer on this GPU (once per "
                      f"model and sparsity; cached in {path.parent})", file=sys.stderr,
                      flush=True)  # fmt: skip

        for i, blk in enumerate(self.blocks):
            if blk.experts is None:
                out.append(SparseSwitch())
                continue
            out.append(
                sparse_switch(
                    blk.experts,
                    blk.experts_fmt,
                    cfg.n_embd,
                    cfg.n_expert_used,
                    cfg.activation,
                    self.expert_threshold[i],
                    key=f"{key}/layer{i}",
                    directory=cache_dir,
                    on_profile=tell,
                )
            )
        return out

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(
        self, tokens: Sequence[int] | torch.Tensor, cache: DeviceKVCache, last_only: bool = False
    ) -> torch.Tensor:
        tok = single_token(tokens, self.config.n_vocab)
        if tok is not None and self._graph_ready(cache):
            return self._replay(tok, cache)
        return self._forward(tokens, cache, last_only)

    def _graph_ready(self, cache: DeviceKVCache) -> bool:
        """True when a decode step is one replay of the graph already captured on `cache`."""
        return (
            self.use_cuda_graph
            and cache.graph is not None
            and cache.graph_key == self._state_version
        )

    def _replay(self, token: int, cache: DeviceKVCache) -> torch.Tensor:
        """Decode fast path: logits [1, n_vocab] f32 on the host of one token through the
        captured graph. Per token the host only writes the step inputs, replays and copies the
        logits back, without entering torch.inference_mode (tens of us per call at batch 1,
        when the whole GPU step is ~1 ms) or building an id tensor."""
        cache.reserve(1)
        logits = self._decode(token, cache)  # the graph is ready: inputs written, one replay
        cache.n_tokens += 1
        # Through pinned memory (torch's caching host allocator reuses the block once the caller
        # drops it): a direct copy, not pageable memory's staged one (~8 GB/s here).
        pinned = logits.is_cuda
        out = torch.empty(logits.shape, dtype=torch.float32, pin_memory=pinned)
        out.copy_(logits, non_blocking=pinned)
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
        return out

    @torch.inference_mode()
    def _forward(
        self, tokens: Sequence[int] | torch.Tensor, cache: DeviceKVCache, last_only: bool
    ) -> torch.Tensor:
        ids = token_ids(tokens, self.config.n_vocab)
        n = ids.numel()
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
        [n, n_embd] (normed, matmul dtype). attend(q [n_head, n, D], kv) -> [n, n_head * D].

        The residual stream x is updated in place by add_rms_norm (prefill) or replaced by the
        new tensor a fused kernel returns (decode: the norms are folded into the qkv GEMV and
        into the router launch)."""
        cfg = self.config
        eps, alpha = cfg.rms_eps, cfg.residual_scale
        fused = x.shape[0] <= FUSED_MAX_TOKENS
        delta = None  # the previous sub-block's output, added to x by the next norm
        for i, blk in enumerate(self.blocks):
            x, qkv = self._norm_linear(x, delta, blk.attn_norm, blk.wqkv, fused)
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
            if fused and blk.experts is not None:
                with self._part("router"):  # + residual add + ffn norm
                    want_f32 = blk.shared_gate is not None and self.dtype != torch.float32
                    x, h, h32, ids, w = add_norm_router(
                        x, delta, blk.ffn_norm, blk.router, eps, cfg.n_expert_used,
                        cfg.expert_weights_norm, self.dtype, alpha, want_f32,
                    )  # fmt: skip
                delta = self._ffn(i, blk, h, h if h32 is None else h32, (ids, w))
                continue
            split_f32 = self.dtype != torch.float32  # the router wants f32 inputs
            with self._part("norm"):
                h, h32 = add_rms_norm(x, delta, blk.ffn_norm, eps, self.dtype, alpha, split_f32)
            delta = self._ffn(i, blk, h, h if h32 is None else h32)
        with self._part("norm"):
            h, _ = add_rms_norm(x, delta, self.output_norm, eps, self.dtype, alpha)
        self.stats.flush()  # the sparse layers' active counts (inside a captured step too)
        return h

    def _norm_linear(self, x, delta, norm_w, lin: Linear, fused: bool):
        """(new x, lin(rms_norm(x + alpha * delta) * norm_w)): one launch for a Q8_0 weight
        at decode (the norm in the GEMV's prologue), else the norm in place then the matmul."""
        cfg = self.config
        if fused and lin.q is not None and fuse_norm_gemv():
            with self._part("qkv"):  # + residual add + attention norm
                return add_norm_q8_gemv(
                    x, delta, norm_w, cfg.rms_eps, lin.q, lin.d, lin.bias, self.dtype,
                    cfg.residual_scale,
                )  # fmt: skip
        with self._part("norm"):
            h, _ = add_rms_norm(x, delta, norm_w, cfg.rms_eps, self.dtype, cfg.residual_scale)
        with self._part("qkv"):
            return x, lin(h)

    def _ffn(self, i: int, blk: DeviceBlock, h: torch.Tensor, h32: torch.Tensor,
             routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """The FFN sub-block's output [n, n_embd] (before the residual scale). routed: the
        routing (ids, weights) when already computed (decode: add_norm_router)."""
        cfg = self.config
        if blk.experts is None:
            with self._part("dense ffn"):
                return self._gated_ffn(blk.dense_ffn, h)
        if routed is None:
            with self._part("router"):
                logits = h32 @ blk.router.T  # [n, n_expert] f32
                routed = router_topk(logits, cfg.n_expert_used, cfg.expert_weights_norm)
        ids, w = routed
        with self._part("routed experts"):
            threshold = None if self.expert_threshold is None else self.expert_threshold[i]
            y, active = moe_experts(
                h, blk.experts, blk.experts_fmt, ids, w, cfg.activation,
                threshold=threshold, switch=self.sparse_switch[i],
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
            logits = self.output(h, torch.float32)
            scale = self.config.logit_scale
            return logits if scale == 1.0 else logits / scale

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
        cache.set_step(token)
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
        """Host-side counts of one decode step's routed work (replays cannot run Python): the
        pairs of dense and sparse layers, counted once per model state."""
        n_ff, k = self.config.n_ff_exp, self.config.n_expert_used
        if self._decode_counts[0] != self._state_version:
            n_sparse = n_dense = 0
            for i, blk in enumerate(self.blocks):
                if blk.experts is not None:
                    if self.expert_threshold is not None and self.sparse_switch[i].use_sparse(1):
                        n_sparse += k
                    else:
                        n_dense += k
            self._decode_counts = (self._state_version, n_dense, n_sparse)
        _, n_dense, n_sparse = self._decode_counts
        if n_dense:
            self.stats.add_dense(n_dense, n_ff)
        if n_sparse:
            self.stats.add_sparse(n_sparse, n_ff)
