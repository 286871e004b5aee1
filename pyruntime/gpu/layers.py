"""One decoder layer on the GPU, in the pieces a step is made of: the per-layer entry points.

The whole-model step (pyruntime.gpu.executor) runs, for each layer i, with the hidden state
(x, delta): x [n, n_embd] f32 the residual stream, delta the last sub-block's output that the
next norm adds to it (x + residual_scale * delta), so the residual add rides in the norm's
launch:

    x, delta = layers.attention(i, x, delta, kv, span)       # norm, qkv, rope + KV store, attend, o
    r = layers.route(i, x, delta, k)                         # residual add + norm + router + top-k
    y, active = layers.routed_experts(i, r, expert_map=...)  # the routed experts (or a subset)
    delta = layers.ffn_output(i, r, y)                       # + shared expert (gated)
    x = r.x
    (dense-FFN layers: x, h = layers.ffn_norm(i, x, delta); delta = layers.dense_ffn(i, h))
    logits = layers.output(x, delta)

A hybrid executor calls the same pieces one layer at a time and adds its own experts' output
to y before ffn_output. At decode (n <= FUSED_MAX_TOKENS) route() is one launch (kernels.router
add_norm_router). Pieces may update the x they are given in place (the residual add of a norm);
use the x they return. Nothing here synchronizes with the host: a step of these pieces is
captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyruntime.gpu.deltanet import deltanet_prefill
from pyruntime.gpu.mla import mla_attention
from pyruntime.gpu.weights import DeviceBlock, DeviceWeights, GatedFFN, Linear
from pyruntime.kernels.attention import decode_attention
from pyruntime.kernels.decoder_ops import add_rms_norm, qk_rope_store, shared_gate_add
from pyruntime.kernels.deltanet import decode_step
from pyruntime.kernels.dispatch import moe_experts
from pyruntime.kernels.expert_paths import SparseSwitch
from pyruntime.kernels.q8_embed import q8_embed
from pyruntime.kernels.router import add_norm_router, router_topk
from pyruntime.kernels.switch import sparse_switch

if TYPE_CHECKING:
    from pyruntime.model.kv_cache import KVCache
from pyruntime.model.config import ModelConfig
from pyruntime.model.recurrent_state import RecurrentState
from pyruntime.model.reference import activation_fn, attention_mask, route, sink_attention

# Up to this many tokens (decode) the residual add + FFN RMSNorm + router + top-k run in one
# launch (kernels.router.add_norm_router): per layer 5.3 us against 7.7 us for the separate
# launches on an H100 (olmoe shape); above, the separate launches (prefill).
FUSED_MAX_TOKENS = 4
# The batches the sparse expert path runs at when no profiled switch is available (the CPU
# interpreter, or no model key): up to 16 tokens; on CUDA each layer's comes from kernels.switch.
DEFAULT_SWITCH = SparseSwitch.up_to(16)


@dataclass
class Span:
    """Where a step's n tokens go: ids [n] and positions [n] int64 on the device, the rope
    tables of every cache position (cos, sin [max_tokens, rope_dim] f32), and either
    seq_len [1] (decode, one token: the cached length after the step, a device tensor the
    decode attention reads, so a captured graph replays at any position) or start (prefill:
    the first position, for the causal mask)."""

    ids: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    seq_len: torch.Tensor | None = None
    start: int = 0

    @property
    def n(self) -> int:
        return self.ids.shape[0]


@dataclass
class Routed:
    """One MoE layer's FFN input and routing of n tokens, as route() leaves them."""

    x: torch.Tensor  # [n, n_embd] f32: the residual stream after the attention sub-block
    h: torch.Tensor  # [n, n_embd] the experts' input (normed), matmul dtype
    h32: torch.Tensor  # [n, n_embd] f32: the same for the router and the shared-expert gate
    ids: torch.Tensor  # [n, k] int64 experts, in order of routing weight
    weights: torch.Tensor  # [n, k] f32 routing weights
    logits: torch.Tensor  # [n, n_expert] f32 router logits


def embedding_rows(e: Linear, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows ids [n] (on e's device) of an embedding matrix e -> x [n, n_embd] f32 (a new
    tensor) times `scale`: Q8_0 rows gathered and dequantized (kernels.q8_embed), or the float
    rows."""
    if e.w is None:
        return q8_embed(ids, e.q, e.d, scale)
    x = e.w.index_select(0, ids).float()
    return x * scale if scale != 1.0 else x


class DecoderLayers:
    """The model's layers on one device, piece by piece (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, dtype: torch.dtype) -> None:
        self.config = cfg
        self.weights = weights
        self.blocks: list[DeviceBlock] = weights.blocks
        self.dtype = dtype  # activations and float weights
        self.act = activation_fn(cfg.activation)
        self.scale = (
            cfg.attention_scale if cfg.attention_scale is not None else 1 / math.sqrt(cfg.head_dim)
        )
        # Neuron sparsity of the routed experts, per layer: [1] f32 thresholds on |act(gate)|
        # (None: dense) and the batch sizes where the sparse path runs (kernels.switch).
        self.expert_threshold: list[torch.Tensor] | None = None
        self.sparse_switch: list[SparseSwitch] = [DEFAULT_SWITCH] * cfg.n_layer
        self.profile_parts = False  # label each piece for torch.profiler (bench/gpu_decode.py)

    def set_sparsity(self, thresholds: Sequence[float] | None, key: str = "",
                     cache_dir: Path | None = None) -> None:  # fmt: skip
        """Per-layer |act(gate)| thresholds (None = dense). With a `key` (the model's identity
        and sparsity), each layer's dense/sparse switch is profiled on this GPU by
        kernels.switch (once per GPU and layer, cached in cache_dir, default the switch's);
        without one every layer takes DEFAULT_SWITCH."""
        self.sparse_switch = [DEFAULT_SWITCH] * self.config.n_layer
        if thresholds is None:
            self.expert_threshold = None
            return
        device = self.weights.output_norm.device
        self.expert_threshold = [torch.tensor([float(t)], device=device) for t in thresholds]
        if key:
            self.sparse_switch = self.profiled_switch(key, cache_dir)

    def profiled_switch(self, key: str, cache_dir: Path | None = None) -> list[SparseSwitch]:
        """Each layer's profiled dense/sparse switch (kernels.switch.sparse_switch); one line on
        stderr before the first layer that has to be timed."""
        cfg = self.config
        told = False

        def tell(path) -> None:
            nonlocal told
            if not told:
                told = True
                print(f"pyruntime: timing dense vs sparse experts per layer on this GPU (once per "
                      f"model and sparsity; cached in {path.parent})", file=sys.stderr,
                      flush=True)  # fmt: skip

        out = []
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
                )  # fmt: skip
            )
        return out

    def part(self, name: str):
        """A profiler range around one piece of a layer, else nothing."""
        if self.profile_parts:
            return torch.profiler.record_function(name)
        return contextlib.nullcontext()

    # -- embedding and output -----------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] on the device -> x [n, n_embd] f32 (a new tensor), times the embedding scale
        (embedding_rows)."""
        return embedding_rows(self.weights.token_embd, ids, self.config.embedding_scale)

    def output(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """Logits [n, n_vocab] f32 of the last layer's state (final norm, lm_head)."""
        cfg = self.config
        with self.part("norm"):
            h, _ = add_rms_norm(x, delta, self.weights.output_norm, cfg.rms_eps, self.dtype,
                                cfg.residual_scale)  # fmt: skip
        with self.part("lm_head"):
            logits = self.weights.output(h, torch.float32)
            return logits if cfg.logit_scale == 1.0 else logits / cfg.logit_scale

    # -- attention sub-block ------------------------------------------------------------------

    def mixer(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, cache: KVCache,
              span: Span) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Layer i's token mixer, by its kind: attention over cache.kv[i], a Gated DeltaNet
        layer on the cache's recurrent state (qwen35moe), which advances by span's tokens, or
        multi-head latent attention over cache.kv[i]'s plane of latents (deepseek2)."""
        blk = self.blocks[i]
        if blk.deltanet is not None:
            return self.deltanet(i, x, delta, cache.recurrent, span)
        if blk.mla is not None:
            return self.mla(i, x, delta, cache.kv[i], span)
        return self.attention(i, x, delta, cache.kv[i], span)

    def attention(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, kv: torch.Tensor,
                  span: Span) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Layer i's attention sub-block: (x + residual_scale * delta, its output [n, n_embd]).
        kv: layer i's cache storage [2, n_head_kv, max_tokens, head_dim]; the tokens' keys and
        values are written at span.positions."""
        cfg, blk = self.config, self.blocks[i]
        with self.part("norm"):
            h, _ = add_rms_norm(x, delta, blk.attn_norm, cfg.rms_eps, self.dtype,
                                cfg.residual_scale)  # fmt: skip
        with self.part("qkv"):
            qkv = blk.wqkv(h)
        with self.part("rope+kv store"):
            q = qk_rope_store(
                qkv, kv, span.positions, span.cos, span.sin, cfg.n_head, blk.q_norm, blk.k_norm,
                cfg.rms_eps, cfg.clamp_kqv, rope=not blk.nope,
                l2_norm=cfg.qk_l2_norm and not blk.nope, temperature=self._temperature(blk),
            )  # fmt: skip
        with self.part("attention"):
            if span.seq_len is not None:  # one token: split-K kernel, length on the device
                a = decode_attention(q[:, 0], kv[0], kv[1], span.seq_len, self.scale,
                                     window=blk.window, sinks=blk.sinks,
                                     chunk=blk.chunk)  # fmt: skip
                a = a.reshape(1, -1)
            else:
                end = span.start + span.n
                a = self._prefill_attention(q, kv[0, :, :end], kv[1, :, :end], span.start, blk)
        if blk.attn_gate is not None:  # qwen35moe: a sigmoid gate per output
            with self.part("attention gate"):
                a = a * torch.sigmoid(blk.attn_gate(h, torch.float32)).to(a.dtype)
        with self.part("o_proj"):
            return x, blk.wo(a)

    def _temperature(self, blk: DeviceBlock) -> tuple[int, float] | None:
        """(length, scale) of a llama4 NoPE layer's query temperature, else None."""
        cfg = self.config
        if blk.nope and cfg.temperature_length:
            return cfg.temperature_length, cfg.temperature_scale
        return None

    def mla(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, kv: torch.Tensor,
            span: Span) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Layer i's multi-head latent attention sub-block (gpu.mla): (x + residual_scale *
        delta, its output [n, n_embd]). kv: layer i's cache storage [1, 1, max_tokens, rank +
        rope]; the tokens' latents are written at span.positions."""
        cfg, blk = self.config, self.blocks[i]
        with self.part("norm"):
            h, _ = add_rms_norm(x, delta, blk.attn_norm, cfg.rms_eps, self.dtype,
                                cfg.residual_scale)  # fmt: skip
        with self.part("latent attention"):
            a = mla_attention(cfg, blk.mla, h, kv[0, 0], span.positions, span.cos, span.sin,
                              span.seq_len, span.start, self.scale)  # fmt: skip
        with self.part("o_proj"):
            return x, blk.wo(a)

    def deltanet(self, i: int, x: torch.Tensor, delta: torch.Tensor | None,
                 state: RecurrentState, span: Span):  # fmt: skip
        """Layer i's Gated DeltaNet sub-block (kernels.deltanet): (x + residual_scale * delta,
        its output [n, n_embd]); the layer's conv and ssm states (in `state`) advance by the
        span's tokens: one token through the decode kernel, several through the chunked form."""
        cfg, blk = self.config, self.blocks[i]
        d = blk.deltanet
        with self.part("norm"):
            h, _ = add_rms_norm(x, delta, blk.attn_norm, cfg.rms_eps, self.dtype,
                                cfg.residual_scale)  # fmt: skip
        with self.part("deltanet in_proj"):
            proj = d.in_proj(h)  # [n, C + Hv dv + 2 Hv]
        conv, ssm = state.conv[i], state.ssm[i]
        with self.part("deltanet"):
            if span.seq_len is not None:
                o = decode_step(cfg, proj[0], conv, d.conv, ssm, d.a, d.dt_bias, d.norm,
                                self.dtype)  # fmt: skip
            else:
                o = deltanet_prefill(cfg, proj, d.conv, conv, ssm, d.a, d.dt_bias, d.norm,
                                     self.dtype)  # fmt: skip
        with self.part("deltanet out_proj"):
            return x, d.out(o)

    def _prefill_attention(self, q, keys, values, start: int, blk: DeviceBlock) -> torch.Tensor:
        """q [n_head, n, D]; keys, values [n_head_kv, start + n, D] -> [n, n_head * D].

        torch SDPA on 4-D [1, heads, tokens, D] views (its fused kernels take no 3-D input: a
        3-D call runs the unfused math path, scores materialized). A prompt from position 0
        without a window is plain causal attention: is_causal and grouped heads by enable_gqa,
        no mask, which CUDA runs in the flash kernel (bf16 / f16, head_dim <= 256). After
        earlier tokens (start > 0) or with a window the causal mask is explicit (SDPA's
        is_causal aligns the diagonal top-left) and the kv heads are repeated: the
        memory-efficient kernel, which takes a mask but not enable_gqa."""
        cfg = self.config
        n, end = q.shape[1], keys.shape[1]
        group = cfg.n_head // cfg.n_head_kv
        if blk.sinks is not None:
            if group > 1:
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            mask = attention_mask(start, end, blk.window, q.device, blk.chunk)
            out = sink_attention(q.float(), keys.float(), values.float(), mask, self.scale,
                                 blk.sinks).to(q.dtype)  # fmt: skip
        elif start == 0 and not blk.window and not blk.chunk:
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], is_causal=True, scale=self.scale,
                enable_gqa=group > 1,
            )[0]  # fmt: skip
        else:
            if group > 1:
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            # Causal over absolute positions (query at start+a sees keys 0..start+a), windowed
            # or chunked
            mask = attention_mask(start, end, blk.window, q.device, blk.chunk)  # [n, end]
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                                 attn_mask=mask, scale=self.scale)[0]  # fmt: skip
        return out.transpose(0, 1).reshape(n, cfg.n_head * cfg.head_dim)

    # -- FFN sub-block ------------------------------------------------------------------------

    def route(self, i: int, x: torch.Tensor, delta: torch.Tensor, k: int) -> Routed:
        """MoE layer i's FFN head: residual add, RMSNorm, router logits, softmax top-k experts
        (k of them per token, renormalized as the model says)."""
        cfg, blk = self.config, self.blocks[i]
        eps, alpha = cfg.rms_eps, cfg.residual_scale
        if x.shape[0] <= FUSED_MAX_TOKENS:
            with self.part("router"):  # + residual add + ffn norm
                want_f32 = (
                    blk.shared_gate is not None or cfg.expert_input_weight
                ) and self.dtype != torch.float32
                x, h, h32, ids, w, logits = add_norm_router(
                    x, delta, blk.ffn_norm, blk.router, eps, k, cfg.expert_weights_norm,
                    self.dtype, alpha, want_f32, router_bias=blk.router_bias,
                )  # fmt: skip
            ids, w = self._model_routing(logits, k, ids, w)
            return Routed(x, h, h if h32 is None else h32, ids, w, logits)
        x, h, h32 = self.ffn_norm(i, x, delta, want_f32=True)
        with self.part("router"):
            logits = h32 @ blk.router.T  # [n, n_expert] f32
            if blk.router_bias is not None:
                logits = logits + blk.router_bias
            ids, w = router_topk(logits, k, cfg.expert_weights_norm)
        ids, w = self._model_routing(logits, k, ids, w)
        return Routed(x, h, h32, ids, w, logits)

    def _model_routing(self, logits, k: int, ids, w):
        """deepseek2's routing over the router logits: the top-k within the best groups
        (recomputed by the reference's route), weights times expert_weights_scale; llama4's:
        the same top-k (softmax keeps the logits' order), weighted sigmoid(logit); else ids, w
        as the router kernels chose them."""
        cfg = self.config
        if cfg.expert_input_weight:
            return ids, torch.sigmoid(logits.gather(1, ids))
        if cfg.expert_groups:
            groups = (cfg.expert_groups, cfg.expert_groups_used)
            return route(logits, k, cfg.expert_weights_norm, cfg.expert_weights_scale, groups)
        if cfg.expert_weights_scale != 1.0:
            w = w * cfg.expert_weights_scale
        return ids, w

    def routed_experts(self, i: int, r: Routed, expert_map: torch.Tensor | None = None,
                       slots: torch.Tensor | None = None, fmt: str | None = None):  # fmt: skip
        """MoE layer i's routed experts: (y [n, n_embd] f32, active [n, k] int32 neuron counts,
        or None where the dense path ran). expert_map: int32 [n_expert] expert -> slot of
        `slots` (default: the layer's expert tensor), -1 for experts not computed here
        (kernels.moe_args). slots: an expert tensor in the layer's prepared format (a cache of
        expert slots), or in `fmt` (the GGUF's experts read in place from host memory)."""
        blk = self.blocks[i]
        threshold = None if self.expert_threshold is None else self.expert_threshold[i]

        def run(h, ids, weights):
            return moe_experts(
                h, blk.experts if slots is None else slots, fmt or blk.experts_fmt, ids, weights,
                self.config.activation, threshold, self.sparse_switch[i], expert_map,
                blk.expert_bias,
            )  # fmt: skip

        with self.part("routed experts"):
            if not self.config.expert_input_weight:
                return run(r.h, r.ids, r.weights)
            return self._input_weighted(r, run)

    def _input_weighted(self, r: Routed, run):
        """llama4's experts (model.llama4.input_weighted_experts): per slot s, run(h * w_s,
        ids_s, 1): the routing weight scales the expert's input (in f32, then the matmul
        dtype), the outputs are summed. One call at top-1, the released models' k."""
        ones = torch.ones_like(r.weights[:, :1])
        y, active = None, []
        for s in range(r.ids.shape[1]):
            hs = (r.h32 * r.weights[:, s : s + 1]).to(self.dtype)
            ys, act = run(hs, r.ids[:, s : s + 1].contiguous(), ones)
            y = ys if y is None else y + ys
            active.append(act)
        return y, None if active[0] is None else torch.cat(active, dim=1)

    def ffn_output(self, i: int, r: Routed, y: torch.Tensor) -> torch.Tensor:
        """MoE layer i's FFN output [n, n_embd]: the routed experts' y plus the shared expert
        (times its sigmoid gate); the next norm adds it to r.x."""
        blk = self.blocks[i]
        if blk.shared is None:
            return y
        with self.part("shared expert"):
            s = self._gated_ffn(blk.shared, r.h)
            if blk.shared_gate is not None:  # + its gate: one launch (kernels.decoder_ops)
                return shared_gate_add(y, s, r.h32, blk.shared_gate)
            return y + s.float()

    def ffn_norm(self, i: int, x: torch.Tensor, delta: torch.Tensor | None,
                 want_f32: bool = False):  # fmt: skip
        """Layer i's FFN norm: (x + residual_scale * delta (in place), h in the matmul dtype,
        h in f32 (want_f32; h itself when that is f32) or None)."""
        cfg = self.config
        split_f32 = want_f32 and self.dtype != torch.float32
        with self.part("norm"):
            h, h32 = add_rms_norm(x, delta, self.blocks[i].ffn_norm, cfg.rms_eps, self.dtype,
                                  cfg.residual_scale, split_f32)  # fmt: skip
        return x, h, (h if want_f32 and h32 is None else h32)

    def dense_ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Dense-FFN layer i's output (layers without routed experts)."""
        with self.part("dense ffn"):
            return self._gated_ffn(self.blocks[i].dense_ffn, h)

    def _gated_ffn(self, w: GatedFFN, x: torch.Tensor) -> torch.Tensor:
        g, u = w.gate_up(x).chunk(2, dim=-1)
        return w.down((self.act(g) * u).to(x.dtype))
