"""One decode step of a whole model in one C call (runtime/src/decode.c, pyrt_decoder_step).

`CpuDecoder` describes the model's host weights (pyruntime.model.weights) to the C core once:
pointers into the GGUF mmap for every weight matrix (read in place, in its stored format),
pointers to the small F32 tensors (norms, biases), and the scalars of the family. A step then
runs embedding, every block (attention with the KV cache, router, routed experts, shared expert
or dense FFN) and the output matrix on the core's thread pool, without a torch op or a return to
Python in between.

The KV cache is the model's KVCache: the step reads positions < pos that prefill (torch path)
wrote and writes position pos in the same [n_head_kv, capacity, head_dim] tensors. Pointers are
taken at call time and kept in the cache's executor_state, which the cache clears when its
storage moves.
"""

from __future__ import annotations

import math

import torch

from pyruntime.cpu import core as cpu_core
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.weights import HostWeights


class CpuDecoder:
    """Owner of a C decoder (pyrt_decoder) for one model on one CpuCore; freed with the object."""

    def __init__(self, cfg: ModelConfig, weights: HostWeights, core: cpu_core.CpuCore) -> None:
        self._ffi = ffi = cpu_core._ffi
        self._lib = lib = cpu_core._lib()
        self.config = cfg
        self.core = core
        self._keep: list[object] = []  # buffers whose memory the C side borrows
        blocks = ffi.new("pyrt_block_weights[]", cfg.n_layer)
        self._keep.append(blocks)
        for i, blk in enumerate(weights.blocks):
            self._describe_block(blocks[i], blk)
        w = ffi.new("pyrt_model_weights *")
        w.n_vocab, w.n_embd, w.n_layer = cfg.n_vocab, cfg.n_embd, cfg.n_layer
        w.n_head, w.n_head_kv, w.head_dim, w.rope_dim = (
            cfg.n_head,
            cfg.n_head_kv,
            cfg.head_dim,
            cfg.rope_dim,
        )
        w.n_expert, w.n_expert_used, w.n_ff_exp = cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp
        w.expert_weights_norm = int(cfg.expert_weights_norm)
        w.activation = cpu_core.ACTIVATIONS[cfg.activation]
        w.rms_eps = cfg.rms_eps
        w.embedding_scale = cfg.embedding_scale
        w.residual_scale = cfg.residual_scale
        scale = cfg.attention_scale
        w.attention_scale = 1 / math.sqrt(cfg.head_dim) if scale is None else scale
        w.logit_scale = cfg.logit_scale
        w.clamp_kqv = 0.0 if cfg.clamp_kqv is None else cfg.clamp_kqv
        # theta^(-2i/d) exactly as rope_tables (model/reference.py) computes it, in float32
        d = cfg.rope_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        w.rope_inv_freq = self._floats(inv_freq)
        self._set_matrix(w.token_embd, weights.token_embd)
        self._set_matrix(w.output, weights.output)
        w.output_norm = self._floats(weights.output_norm)
        w.blocks = blocks
        out = ffi.new("pyrt_decoder **")
        cpu_core._check(lib.pyrt_decoder_create(w, out), "pyrt_decoder_create")
        self._dec = ffi.gc(out[0], lib.pyrt_decoder_free)
        self.n_moe_layers = sum(blk.experts is not None for blk in weights.blocks)
        self._n_active = ffi.new("int64_t *")

    # ---- description of the weights ----------------------------------------------------------

    def _floats(self, t: torch.Tensor | None):
        """const float * to a contiguous float32 tensor's data (kept alive), or NULL."""
        if t is None:
            return self._ffi.NULL
        t = t.detach().to(torch.float32).contiguous().reshape(-1)
        self._keep.append(t)
        return self._ffi.cast("const float *", t.data_ptr())

    def _set_matrix(self, dst, m: QuantMatrix | None) -> None:
        if m is None:
            return  # left zeroed: data == NULL means absent
        buf = self._ffi.from_buffer(m.raw)
        self._keep.append(buf)
        dst.data = buf
        dst.bytes = m.raw.nbytes
        dst.fmt = int(m.qtype)
        dst.n_out, dst.n_in = m.shape

    def _describe_block(self, b, blk) -> None:
        b.attn_norm = self._floats(blk.attn_norm)
        for name in ("wq", "wk", "wv", "wo"):
            self._set_matrix(getattr(b, name), getattr(blk, name))
        b.bq, b.bk, b.bv = (self._floats(t) for t in (blk.bq, blk.bk, blk.bv))
        b.q_norm, b.k_norm = self._floats(blk.q_norm), self._floats(blk.k_norm)
        b.q_norm_len = 0 if blk.q_norm is None else blk.q_norm.numel()
        b.k_norm_len = 0 if blk.k_norm is None else blk.k_norm.numel()
        b.ffn_norm = self._floats(blk.ffn_norm)
        if blk.experts is not None:
            self._set_matrix(b.router, blk.router)
            gud = self._ffi.from_buffer(blk.experts.raw)
            self._keep.append(gud)
            b.gud, b.gud_bytes, b.gud_fmt = gud, blk.experts.raw.nbytes, int(blk.experts.qtype)
            if blk.shared is not None:
                self._set_matrix(b.sh_gate, blk.shared.gate)
                self._set_matrix(b.sh_up, blk.shared.up)
                self._set_matrix(b.sh_down, blk.shared.down)
                b.sh_gate_inp = self._floats(blk.shared_gate)
        else:
            self._set_matrix(b.ffn_gate, blk.dense_ffn.gate)
            self._set_matrix(b.ffn_up, blk.dense_ffn.up)
            self._set_matrix(b.ffn_down, blk.dense_ffn.down)

    # ---- the step ----------------------------------------------------------------------------

    def _cache_pointers(self, cache: KVCache):
        """(k pointers, v pointers, capacity) of the cache's current storage, kept in the
        cache's executor_state until the storage moves."""
        pointers = cache.executor_state.get("cpu")
        if pointers is None:
            ffi = self._ffi
            if cache.device.type != "cpu" or cache.dtype != torch.float32:
                raise cpu_core.CoreError("the C decode step needs a float32 KV cache on the CPU")
            kp = ffi.new("float *[]", [ffi.cast("float *", t.data_ptr()) for t in cache.k])
            vp = ffi.new("float *[]", [ffi.cast("float *", t.data_ptr()) for t in cache.v])
            if not all(t.is_contiguous() for t in (*cache.k, *cache.v)):
                raise cpu_core.CoreError("the KV cache storage is not contiguous")
            pointers = cache.executor_state["cpu"] = (kp, vp, cache.capacity)
        return pointers

    def _thresholds(self, thr: list[float] | None):
        """float * of the per-layer thresholds (NULL: dense), rebuilt when the list changes."""
        if thr is None:
            return self._ffi.NULL
        values = [0.0 if t is None else float(t) for t in thr]
        if getattr(self, "_thr_values", None) != values:
            self._thr_values = values
            self._thr_array = self._ffi.new("float[]", values)
        return self._thr_array

    def step(
        self, token: int, cache: KVCache, thresholds: list[float] | None = None
    ) -> tuple[torch.Tensor, int]:
        """(logits [1, n_vocab] float32, routed neurons computed) after `token` at position
        cache.n_tokens; advances the cache by one position. The caller has reserved room for it
        (KVCache.reserve). thresholds: per-layer sparsity thresholds, or None (dense)."""
        ffi = self._ffi
        kp, vp, cap = self._cache_pointers(cache)
        pos = cache.n_tokens
        logits = torch.empty((1, self.config.n_vocab), dtype=torch.float32)
        cpu_core._check(
            self._lib.pyrt_decoder_step(
                self._dec,
                self.core._pool,
                token,
                pos,
                kp,
                vp,
                cap,
                self._thresholds(thresholds),
                ffi.cast("float *", logits.data_ptr()),
                self._n_active,
            ),
            "pyrt_decoder_step",
        )
        cache.n_tokens = pos + 1
        return logits, int(self._n_active[0])

    def times(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent in the steps since the last reset: attention (with the embedding), ffn
        (router, routed and shared experts, dense FFN), output (final norm, output matrix), and
        the number of steps."""
        ns = self._ffi.new("int64_t[4]")
        cpu_core._check(self._lib.pyrt_decoder_times(self._dec, ns, int(reset)), "times")
        return {
            "attention": ns[0] * 1e-9,
            "ffn": ns[1] * 1e-9,
            "output": ns[2] * 1e-9,
            "steps": int(ns[3]),
        }
