"""One decode step of a whole model in one C call (runtime/src/decode.c, pyrt_decoder_step).

`CpuDecoder` describes the model's host weights (pyruntime.model.weights) to the C core once:
pointers into the GGUF mmap for every weight matrix (read in place, in its stored format),
pointers to the small F32 tensors (norms, biases), and the scalars of the family. A step then
runs embedding, every block (attention with the KV cache, router, routed experts, shared expert
or dense FFN) and the output matrix on the core's thread pool, without a torch op or a return to
Python in between.

What a step can do beyond the model's defaults (the seams offloading and big/little use):
- k: experts per token for this step (1..n_expert; the chosen k are renormalized as the model
  says), default the model's n_expert_used;
- route_ids / route_logits: every layer's chosen experts and router logits, written into tensors
  the caller owns (no work when not asked);
- expert_maps: per layer, which experts are computed here (the rest elsewhere, e.g. on a GPU);
- the same step in pieces: begin(), attention(i), ffn(i) per layer, end(), with read_x() /
  write_x() on the residual stream between them (the same bits as step()).

The KV cache is the model's KVCache: the step reads positions < pos that prefill (torch path)
wrote and writes position pos in the same [n_head_kv, capacity, head_dim] tensors. Pointers are
taken at call time and kept in the cache's executor_state, which the cache clears when its
storage moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pyruntime.cpu import core as cpu_core
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.rope import attention_factor, inv_frequencies
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
            blocks[i].window = cfg.layer_window(i)
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
        # the frequencies (and YaRN's cos/sin factor) exactly as the reference computes them
        w.rope_inv_freq = self._floats(inv_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_yarn))
        w.rope_scale = attention_factor(cfg.rope_yarn)
        w.swiglu_alpha, w.swiglu_limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self._set_matrix(w.token_embd, weights.token_embd)
        self._set_matrix(w.output, weights.output)
        w.output_norm = self._floats(weights.output_norm)
        w.blocks = blocks
        out = ffi.new("pyrt_decoder **")
        cpu_core._check(lib.pyrt_decoder_create(w, out), "pyrt_decoder_create")
        self._dec = ffi.gc(out[0], lib.pyrt_decoder_free)
        self.n_moe_layers = sum(blk.experts is not None for blk in weights.blocks)
        self._args = ffi.new("pyrt_step_args *")  # one step's arguments, reused
        self._bound = None  # the cache pointers _args holds
        self._extras = False  # _args holds k, maps or routing outputs of an earlier step
        self._keep_step: list = []  # the maps _args borrows
        self.n_pairs = 0  # (token, expert) pairs the last step computed

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
        b.bq, b.bk, b.bv, b.bo = (self._floats(t) for t in (blk.bq, blk.bk, blk.bv, blk.bo))
        b.sinks = self._floats(blk.sinks)
        b.q_norm, b.k_norm = self._floats(blk.q_norm), self._floats(blk.k_norm)
        b.q_norm_len = 0 if blk.q_norm is None else blk.q_norm.numel()
        b.k_norm_len = 0 if blk.k_norm is None else blk.k_norm.numel()
        b.ffn_norm = self._floats(blk.ffn_norm)
        if blk.experts is not None:
            self._set_matrix(b.router, blk.router)
            b.router_bias = self._floats(blk.router_bias)
            if blk.experts.bias is not None:
                b.exp_bias_gu = self._floats(blk.experts.bias.gate_up)
                b.exp_bias_down = self._floats(blk.experts.bias.down)
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

    def _out(self, t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], name: str):
        """The data pointer of an output tensor the caller allocated (NULL for None)."""
        if t is None:
            return self._ffi.NULL
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype is dtype
            and t.is_cpu
            and tuple(t.shape) == shape
            and t.is_contiguous()
        ):
            raise cpu_core.CoreError(
                f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got "
                f"{cpu_core._describe(t)}"
            )
        return self._ffi.cast("int32_t *" if dtype is torch.int32 else "float *", t.data_ptr())

    def _maps(self, expert_maps: Sequence[torch.Tensor | None] | None, keep: list):
        """const int32_t *const * of per-layer expert maps (NULL: every expert here)."""
        if expert_maps is None:
            return self._ffi.NULL
        cfg = self.config
        if len(expert_maps) != cfg.n_layer:
            raise cpu_core.CoreError(
                f"expert_maps has {len(expert_maps)} entries, expected one per layer "
                f"({cfg.n_layer}; None where every expert is computed here)"
            )
        ptrs = []
        for i, m in enumerate(expert_maps):
            if m is None:
                ptrs.append(self._ffi.NULL)
                continue
            m = cpu_core._as_cpu(m, torch.int32, f"expert_maps[{i}]", 1)
            if m.shape != (cfg.n_expert,):
                raise cpu_core.CoreError(
                    f"expert_maps[{i}] has shape {tuple(m.shape)}, expected ({cfg.n_expert},)"
                )
            keep.append(m)
            ptrs.append(self._ffi.cast("const int32_t *", m.data_ptr()))
        array = self._ffi.new("const int32_t *[]", ptrs)
        keep.append(array)
        return array

    def _prepare(
        self,
        token: int,
        cache: KVCache,
        thresholds: list[float] | None,
        k: int | None,
        route_ids: torch.Tensor | None,
        route_logits: torch.Tensor | None,
        expert_maps: Sequence[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        """Fills the step's pyrt_step_args for `token` at position cache.n_tokens; returns the
        logits tensor [1, n_vocab] it will write. What the C side borrows is kept alive by the
        cache (its pointers), self (thresholds) and _keep_step (maps). A plain step sets only
        what changes (token, position, logits; the cache's pointers when they move)."""
        ffi, cfg, a = self._ffi, self.config, self._args
        pointers = self._cache_pointers(cache)
        if pointers is not self._bound:  # another cache, or its storage moved
            a.k_cache, a.v_cache, a.cache_cap = pointers
            self._bound = pointers
        logits = torch.empty((1, cfg.n_vocab), dtype=torch.float32)
        a.token, a.pos = token, cache.n_tokens
        a.thresholds = self._thresholds(thresholds)
        a.logits = ffi.cast(cpu_core._P_FLOAT, logits.data_ptr())
        extras = not (k is None and route_ids is None and route_logits is None)
        if extras or expert_maps is not None or self._extras:  # else they are all unset still
            n_k = cfg.n_expert_used if k is None else k
            if not isinstance(n_k, int) or not 1 <= n_k <= cfg.n_expert:
                raise cpu_core.CoreError(
                    f"k={k!r} experts per token is outside [1, n_expert={cfg.n_expert}]"
                )
            keep: list = []
            a.k = n_k
            a.expert_maps = self._maps(expert_maps, keep)
            a.route_ids = self._out(route_ids, torch.int32, (cfg.n_layer, n_k), "route_ids")
            a.route_logits = self._out(
                route_logits, torch.float32, (cfg.n_layer, cfg.n_expert), "route_logits"
            )
            self._keep_step = keep
            self._extras = extras or expert_maps is not None
        return logits

    def step(
        self,
        token: int,
        cache: KVCache,
        thresholds: list[float] | None = None,
        *,
        k: int | None = None,
        route_ids: torch.Tensor | None = None,
        route_logits: torch.Tensor | None = None,
        expert_maps: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """(logits [1, n_vocab] float32, routed neurons computed) after `token` at position
        cache.n_tokens; advances the cache by one position. The caller has reserved room for it
        (KVCache.reserve).

        thresholds: per-layer sparsity thresholds, or None (dense).
        k: experts per token for this step, 1..n_expert (None: the model's n_expert_used).
        route_ids: None, or an int32 tensor [n_layer, k] that receives each MoE layer's chosen
            experts in order of routing weight (-1 rows for dense-FFN layers).
        route_logits: None, or a float32 tensor [n_layer, n_expert] that receives each MoE
            layer's router logits before the softmax (NaN rows for dense-FFN layers).
        expert_maps: None, or one entry per layer: None (every expert computed here) or an int
            tensor [n_expert], expert id -> itself if computed here, -1 if computed elsewhere
            (its pairs are skipped; the caller adds their share to the residual stream, see the
            per-layer calls). Dense-FFN layers ignore theirs.
        After the step, self.n_pairs holds the (token, expert) pairs it computed."""
        logits = self._prepare(token, cache, thresholds, k, route_ids, route_logits, expert_maps)
        cpu_core._check(
            self._lib.pyrt_decoder_step(self._dec, self.core._pool, self._args),
            "pyrt_decoder_step",
        )
        cache.n_tokens += 1
        self.n_pairs = int(self._args.n_pairs)
        return logits, int(self._args.n_active)

    # ---- the step in pieces ------------------------------------------------------------------

    def begin(
        self,
        token: int,
        cache: KVCache,
        thresholds: list[float] | None = None,
        *,
        k: int | None = None,
        route_ids: torch.Tensor | None = None,
        route_logits: torch.Tensor | None = None,
        expert_maps: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Starts a step in pieces (arguments as step()): the residual stream x becomes the
        embedding of `token`. Then attention(i) and ffn(i) for every layer i in order, then end();
        read_x() / write_x() in between hand the residual stream to other hardware and back."""
        self._logits = self._prepare(
            token, cache, thresholds, k, route_ids, route_logits, expert_maps
        )
        self._cache = cache
        cpu_core._check(
            self._lib.pyrt_decoder_begin(self._dec, self.core._pool, self._args),
            "pyrt_decoder_begin",
        )

    def attention(self, layer: int) -> None:
        """x += the attention half of block `layer` (writes the token's k, v into the cache)."""
        cpu_core._check(
            self._lib.pyrt_decoder_attention(self._dec, self.core._pool, layer, self._args),
            "pyrt_decoder_attention",
        )

    def ffn(self, layer: int) -> None:
        """x += the FFN half of block `layer` (router, routed experts of its map, shared expert;
        or the dense FFN); fills that layer's rows of route_ids / route_logits."""
        cpu_core._check(
            self._lib.pyrt_decoder_ffn(self._dec, self.core._pool, layer, self._args),
            "pyrt_decoder_ffn",
        )

    def end(self) -> tuple[torch.Tensor, int]:
        """(logits [1, n_vocab], routed neurons computed) from x; advances the cache by one
        position, as step() does."""
        cpu_core._check(
            self._lib.pyrt_decoder_end(self._dec, self.core._pool, self._args),
            "pyrt_decoder_end",
        )
        self._cache.n_tokens += 1
        self.n_pairs = int(self._args.n_pairs)
        return self._logits, int(self._args.n_active)

    def read_x(self) -> torch.Tensor:
        """A copy of the residual stream x [n_embd] float32."""
        x = torch.empty(self.config.n_embd, dtype=torch.float32)
        cpu_core._check(
            self._lib.pyrt_decoder_read_x(self._dec, self._ffi.cast("float *", x.data_ptr())),
            "pyrt_decoder_read_x",
        )
        return x

    def write_x(self, x: torch.Tensor) -> None:
        """Sets the residual stream x [n_embd] (any float dtype; converted to float32)."""
        x = cpu_core._as_cpu(x, torch.float32, "x", 1)
        if x.shape != (self.config.n_embd,):
            raise cpu_core.CoreError(
                f"x has shape {tuple(x.shape)}, expected ({self.config.n_embd},)"
            )
        cpu_core._check(
            self._lib.pyrt_decoder_write_x(
                self._dec, self._ffi.cast("const float *", x.data_ptr())
            ),
            "pyrt_decoder_write_x",
        )

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
