"""The model as the C decoder reads it: a pyrt_model_weights built from the host weights.

Every weight matrix is a pointer into the GGUF mmap (read in place, in its stored format) with its
byte count and shape (deepseek2's multi-head latent attention's too); every small float32 tensor
(norms, biases, q/k norms, the shared expert's gate, the RoPE frequencies, gpt-oss's sinks and
router / expert biases, MLA's latent norms) a pointer with its element count (llama4's chunks,
NoPE layers, q/k L2 norm, temperature and input-weighted experts are plain numbers): the C side
checks each length against the model's shape once, at pyrt_decoder_create, and
never reads past it. Optionally, per MoE layer, the routed experts' gate rows apart
(pyruntime.experts.gates), which the sparse decode steps read instead of the file's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pyruntime.cpu import core as cpu_core
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.rope import attention_factor, inv_frequencies
from pyruntime.model.weights import BlockWeights, HostWeights


class ModelDescription:
    """A pyrt_model_weights (`self.weights`) and the buffers it borrows (kept while this object
    lives: the decoder made from it keeps it). gates: None, or {layer: uint8 [n_expert, n_ff,
    row_bytes]} the MoE layers' gate rows apart (pyruntime.experts.gates.gates_apart)."""

    def __init__(self, cfg: ModelConfig, weights: HostWeights,
                 gates: dict[int, np.ndarray] | None = None) -> None:  # fmt: skip
        self._ffi = ffi = cpu_core._ffi
        self._keep: list[object] = []
        blocks = ffi.new("pyrt_block_weights[]", cfg.n_layer)
        self._keep.append(blocks)
        for i, blk in enumerate(weights.blocks):
            self._describe_block(blocks[i], blk)
            if gates is not None and i in gates:
                buf = ffi.from_buffer(gates[i])
                self._keep.append(buf)
                blocks[i].gud_gates, blocks[i].gud_gates_bytes = buf, gates[i].nbytes
            blocks[i].window = cfg.layer_window(i)
            blocks[i].chunk = cfg.layer_chunk(i)
            blocks[i].nope = int(cfg.is_nope(i))
        w = ffi.new("pyrt_model_weights *")
        w.n_vocab, w.n_embd, w.n_layer = cfg.n_vocab, cfg.n_embd, cfg.n_layer
        w.n_head, w.n_head_kv, w.head_dim = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        w.rope_dim = cfg.rope_dim
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
        inv_freq = inv_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_yarn, cfg.rope_llama3)
        self._set_vector(w.rope_inv_freq, inv_freq)
        w.rope_scale = attention_factor(cfg.rope_yarn)
        w.swiglu_alpha, w.swiglu_limit = cfg.swiglu_alpha, cfg.swiglu_limit
        w.mla_kv_rank, w.mla_q_rank = cfg.mla_kv_rank, cfg.mla_q_rank
        w.mla_nope_dim, w.mla_v_dim = cfg.mla_nope_dim, cfg.mla_v_dim
        w.expert_weights_scale = cfg.expert_weights_scale
        w.expert_groups, w.expert_groups_used = cfg.expert_groups, cfg.expert_groups_used
        w.qk_l2_norm = int(cfg.qk_l2_norm)
        w.temperature_length = cfg.temperature_length
        w.temperature_scale = cfg.temperature_scale
        w.expert_input_weight = int(cfg.expert_input_weight)
        self._set_matrix(w.token_embd, weights.token_embd)
        self._set_matrix(w.output, weights.output)
        self._set_vector(w.output_norm, weights.output_norm)
        w.blocks, w.n_blocks = blocks, cfg.n_layer
        self.weights = w

    def _set_vector(self, dst, t: torch.Tensor | None) -> None:
        """dst (a pyrt_vector) = a float32 copy of t's elements (kept alive) and their count;
        left zeroed (absent) for None."""
        if t is None:
            return
        t = t.detach().to(torch.float32).contiguous().reshape(-1)
        self._keep.append(t)
        dst.data = self._ffi.cast("const float *", t.data_ptr())
        dst.n = t.numel()

    def _set_matrix(self, dst, m: QuantMatrix | None) -> None:
        if m is None:
            return  # left zeroed: data == NULL means absent
        buf = self._ffi.from_buffer(m.raw)
        self._keep.append(buf)
        dst.data = buf
        dst.bytes = m.raw.nbytes
        dst.fmt = int(m.qtype)
        dst.n_out, dst.n_in = m.shape

    def _describe_block(self, b, blk: BlockWeights) -> None:
        for name in ("attn_norm", "bq", "bk", "bv", "bo", "sinks", "q_norm", "k_norm", "ffn_norm"):
            self._set_vector(getattr(b, name), getattr(blk, name))
        for name in ("wk", "wv", "wo") if blk.mla is not None else ("wq", "wk", "wv", "wo"):
            self._set_matrix(getattr(b, name), getattr(blk, name))
        if blk.mla is not None:  # wq_b: attn_q_b, or attn_q without the query LoRA
            m = blk.mla
            self._set_matrix(b.wq_a, m.q_a)
            self._set_vector(b.q_a_norm, m.q_a_norm)
            self._set_matrix(b.wq_b, m.q if m.q_a is None else m.q_b)
            self._set_matrix(b.wkv_a, m.kv_a)
            self._set_vector(b.kv_a_norm, m.kv_a_norm)
            self._set_matrix(b.wk_b, m.k_b)
            self._set_matrix(b.wv_b, m.v_b)
        if blk.experts is not None:
            self._set_matrix(b.router, blk.router)
            self._set_vector(b.router_bias, blk.router_bias)
            if blk.experts.bias is not None:
                self._set_vector(b.exp_bias_gu, blk.experts.bias.gate_up)
                self._set_vector(b.exp_bias_down, blk.experts.bias.down)
            gud = self._ffi.from_buffer(blk.experts.raw)
            self._keep.append(gud)
            b.gud, b.gud_bytes, b.gud_fmt = gud, blk.experts.raw.nbytes, int(blk.experts.qtype)
            if blk.shared is not None:
                self._set_matrix(b.sh_gate, blk.shared.gate)
                self._set_matrix(b.sh_up, blk.shared.up)
                self._set_matrix(b.sh_down, blk.shared.down)
                self._set_vector(b.sh_gate_inp, blk.shared_gate)
        else:
            self._set_matrix(b.ffn_gate, blk.dense_ffn.gate)
            self._set_matrix(b.ffn_up, blk.dense_ffn.up)
            self._set_matrix(b.ffn_down, blk.dense_ffn.down)
