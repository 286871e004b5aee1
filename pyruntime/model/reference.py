"""The model's math in plain torch: the reference every executor is checked against.

The MoE decoder shared by every supported family (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral,
Granite-MoE, GPT-OSS, Qwen3.5-MoE). Per block: RMSNorm -> attention (GQA, optional q/k norm, RoPE
"rotate_half" (plain or YaRN, over all or the first rope_dim dims of a head), KV cache, optional
sliding window, per-head sinks and sigmoid output gate; or a Gated DeltaNet layer on the cache's
recurrent state: pyruntime.model.deltanet) -> residual
-> RMSNorm -> router (softmax, top-k) -> routed experts (+ shared expert) -> residual. Family
differences are data, not code: optional tensors (biases, q/k norms, sinks, shared expert) and
scalars from the GGUF metadata (scales, renormalization, activation, window, rope scaling).

`ReferenceModel` runs it over HostWeights with two pluggable pieces: `linear` (a weight matrix
times activations; default: dequantize and matmul in float32) and `experts` (a layer's routed
experts; default `moe_ffn_torch`). The CPU executor (pyruntime.cpu.executor) plugs the C core
into both for prefill; the GPU executor reimplements the same math in Triton and is tested
against this one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pyruntime.errors import UsageError
from pyruntime.experts.store import ExpertStore
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.deltanet import deltanet_layer
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.kv_cache import KVCache
from pyruntime.model.llama4 import input_weighted_experts, temperature_scales
from pyruntime.model.mla import (
    attention_absorbed,
    attention_plain,
    heads_linear,
    mla_latent,
    mla_query,
)
from pyruntime.model.rope import attention_factor, inv_frequencies, rope_tables
from pyruntime.model.stats import ExpertStats
from pyruntime.model.tokens import token_ids
from pyruntime.model.weights import BlockWeights, FFNWeights, HostWeights

# ---------------------------------------------------------------------------------------------
# Math


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def model_rope_tables(
    cfg: ModelConfig, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rope_dim] of the model's rope (plain or YaRN) at `positions`."""
    inv_freq = inv_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_yarn, cfg.rope_llama3)
    return rope_tables(positions, inv_freq, attention_factor(cfg.rope_yarn))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, head_dim]; rotates the first cos.shape[-1] dims of each head."""
    d = cos.shape[-1]
    xr, xp = x[..., :d], x[..., d:]
    x1, x2 = xr[..., : d // 2], xr[..., d // 2 :]
    rotated = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, xp], dim=-1) if xp.shape[-1] else rotated


def torch_linear(x: torch.Tensor, w: QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, n_in] @ w^T (+ bias) in float32 torch, w dequantized for this call only."""
    return F.linear(x, w.dequantize(), bias)


def dense_ffn(w: FFNWeights, x: torch.Tensor, act: str, linear=torch_linear) -> torch.Tensor:
    return linear(activation_fn(act)(linear(x, w.gate)) * linear(x, w.up), w.down)


def activation_fn(name: str, swiglu: tuple[float, float] = (1.702, 7.0)):
    """act(gate) of an FFN's activation; swiglu_oai's takes its (alpha, limit)."""
    if name == "silu":
        return F.silu
    if name == "gelu":  # tanh approximation (HF "gelu_pytorch_tanh", "gelu_new")
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu_exact":
        return F.gelu
    if name == "swiglu_oai":  # gpt-oss: g * sigmoid(alpha g), g = min(gate, limit)
        alpha, limit = swiglu

        def clamped_swish(x: torch.Tensor) -> torch.Tensor:
            g = x.clamp(max=limit)
            return g * torch.sigmoid(g * alpha)

        return clamped_swish
    raise ValueError(f"unknown activation '{name}'")


def up_fn(name: str, swiglu: tuple[float, float] = (1.702, 7.0)):
    """What multiplies act(gate): the up projection itself, or swiglu_oai's clamp(up) + 1."""
    if name == "swiglu_oai":
        limit = swiglu[1]
        return lambda u: u.clamp(min=-limit, max=limit) + 1
    return lambda u: u


def route(
    router_logits: torch.Tensor,
    k: int,
    renormalize: bool,
    scale: float = 1.0,
    groups: tuple[int, int] = (0, 0),
    sigmoid: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k, optional renormalization, times `scale`
    (docs/gguf-layout.md). groups (n_group, n_used), deepseek2's group-limited top-k: the
    experts split into n_group equal groups, a group scored by its best expert, the top-k taken
    within the n_used best groups only. With `sigmoid` (llama4): top-k of the logits, weighted
    sigmoid(logit).

    router_logits: [T, n_expert] -> (ids [T, k] int64, weights [T, k] f32).
    """
    if sigmoid:
        top, ids = torch.topk(router_logits.float(), k, dim=-1)
        return ids, torch.sigmoid(top)
    probs = torch.softmax(router_logits.float(), dim=-1)
    pick = probs
    if groups[0]:
        T, E = probs.shape
        by_group = probs.view(T, groups[0], E // groups[0])
        best = torch.topk(by_group.amax(-1), groups[1], dim=-1).indices  # [T, n_used]
        keep = torch.zeros(T, groups[0], dtype=torch.bool, device=probs.device)
        keep = keep.scatter_(1, best, True)
        pick = (by_group * keep[..., None]).view(T, E)
    w, ids = torch.topk(pick, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w * scale if scale != 1.0 else w


def expert_ffn_torch(
    w: torch.Tensor,
    x: torch.Tensor,
    act: str,
    threshold: float | None = None,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    swiglu: tuple[float, float] = (1.702, 7.0),
) -> tuple[torch.Tensor, int]:
    """One expert: w [n_ff, 3, n_embd] (gate, up, down^T rows), x [T, n_embd] -> (y, active).

    bias: None, or the expert's (gate_up [n_ff, 2], down [n_embd]) (gpt-oss):
    y = sum_j act(g_j . x + bg_j) * up(u_j . x + bu_j) d_j + bd.
    With `threshold`, neurons whose |act(gate)| < threshold contribute nothing (their up/down
    rows are skipped by the fast kernels); `active` counts the (token, neuron) pairs kept.
    """
    gate, up = x @ w[:, 0, :].T, x @ w[:, 1, :].T  # [T, n_ff]
    if bias is not None:
        gate, up = gate + bias[0][:, 0], up + bias[0][:, 1]
    g = activation_fn(act, swiglu)(gate)
    if threshold is not None:
        keep = g.abs() >= threshold
        g = g * keep
        active = int(keep.sum())
    else:
        active = g.numel()
    h = g * up_fn(act, swiglu)(up)  # [T, n_ff]
    y = h @ w[:, 2, :]  # [T, n_embd]
    return (y if bias is None else y + bias[1]), active


def expert_bias(store: ExpertStore, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Expert e's (gate_up [n_ff, 2], down [n_embd]) biases, or None."""
    return None if store.bias is None else (store.bias.gate_up[e], store.bias.down[e])


def expert_gate_act(store: ExpertStore, e: int, x: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) [T, n_ff] of expert e's neurons for x [T, n_embd] (what sparsity thresholds)."""
    gate = x @ store.expert_weights(e)[:, 0, :].T
    if store.bias is not None:
        gate = gate + store.bias.gate_up[e][:, 0]
    return activation_fn(act, store.swiglu)(gate)


def moe_ffn_torch(
    store: ExpertStore,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    act: str,
    threshold: float | None = None,
) -> tuple[torch.Tensor, int]:
    """x: [T, n_embd] f32; topk_ids: [T, K] int; topk_w: [T, K] f32 -> (y [T, n_embd], n_active)."""
    y = torch.zeros_like(x)
    n_active = 0
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        out, active = expert_ffn_torch(
            store.expert_weights(e), x[tok], act, threshold, expert_bias(store, e), store.swiglu
        )
        y.index_add_(0, tok, out * topk_w[tok, slot].unsqueeze(1))
        n_active += active
    return y, n_active


def check_k(k: int | None, cfg: ModelConfig) -> int:
    """Experts per token for one forward pass: k, or the model's n_expert_used when None."""
    if k is None:
        return cfg.n_expert_used
    if not 1 <= k <= cfg.n_expert:
        raise UsageError(f"experts per token must be in 1..{cfg.n_expert}, got {k}")
    return int(k)


def attention_mask(
    start: int, end: int, window: int = 0, device: torch.device | None = None, chunk: int = 0
) -> torch.Tensor:
    """[end - start, end] bool: the query at absolute position start + a sees key p when
    p <= start + a (causal) and, with a window, start + a - p < window; with a chunk, when p is
    in the query's chunk (p // chunk == (start + a) // chunk)."""
    q_pos = torch.arange(start, end, device=device)[:, None]
    k_pos = torch.arange(end, device=device)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= q_pos - k_pos < window
    if chunk:
        mask &= q_pos // chunk == k_pos // chunk
    return mask


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sink[h]) (gpt-oss): q [H, n, D],
    keys/values [H, end, D], mask [n, end], sinks [H] -> [H, n, D]."""
    scores = (q @ keys.transpose(1, 2)) * scale  # [H, n, end]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return probs @ values


# Routed experts of one layer: (store, x [T, n_embd], ids [T, K], weights [T, K], activation,
# threshold or None) -> (y [T, n_embd], neurons computed).
ExpertFn = Callable[..., tuple[torch.Tensor, int]]
# A weight matrix times activations: (x [T, n_in], w, bias or None) -> [T, n_out].
LinearFn = Callable[..., torch.Tensor]

# ---------------------------------------------------------------------------------------------
# The forward pass


class ReferenceModel:
    """Forward pass with a KV cache. `forward` returns float32 logits [n_tokens, n_vocab]."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: HostWeights,
        linear: LinearFn = torch_linear,
        experts: ExpertFn = moe_ffn_torch,
    ) -> None:
        self.config = cfg
        self.weights = weights
        self.linear = linear
        # A per-head matvec (MLA's absorbed decode): x [H, n, n_in], m [H rows, n_in] ->
        # [H, n, rows]; None: one `linear` call per head
        self.heads_linear = None
        self.expert_backend = experts
        self.expert_threshold: list[float] | None = None  # per layer, for neuron sparsity
        # Calibration hook: (layer, store, x [T, n_embd], ids [T, K], activation) -> None.
        self.gate_observer = None
        self.stats = ExpertStats()

    @property
    def blocks(self) -> list[BlockWeights]:
        return self.weights.blocks

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(self.config, max_tokens)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Nothing to do: without a file to page in from, the weights are where they are."""

    def moe_layers(self) -> list[int]:
        """Indices of the layers with routed experts (the others have a dense FFN)."""
        return [i for i, blk in enumerate(self.weights.blocks) if blk.experts is not None]

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
        *,
        k: int | None = None,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        """Logits [n_tokens, n_vocab] (or [1, n_vocab] with last_only) float32; the Executor
        protocol (pyruntime.model.executor): k experts per token (None: the model's), routing
        filled with what the last token routed."""
        return self._forward_torch(tokens, cache, last_only, k, routing)

    @torch.inference_mode()
    def _forward_torch(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: KVCache,
        last_only: bool,
        k: int | None = None,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        cfg, w = self.config, self.weights
        k = check_k(k, cfg)
        trace: list[tuple[torch.Tensor, torch.Tensor]] | None = None if routing is None else []
        ids = token_ids(tokens, cfg.n_vocab)
        n = ids.numel()
        self.stats.begin("prefill" if n > 1 else "decode")
        cache.reserve(n)
        start = cache.n_tokens
        cos, sin = model_rope_tables(cfg, torch.arange(start, start + n))
        x = w.token_embd.rows(ids) * cfg.embedding_scale  # [n, n_embd]
        for i, blk in enumerate(w.blocks):
            normed = rms_norm(x, blk.attn_norm, cfg.rms_eps)
            if blk.deltanet is not None:
                h = self._deltanet(i, blk, normed, cache)
            elif blk.mla is not None:
                h = self._mla(i, blk, normed, cache, cos, sin)
            else:
                h = self._attention(i, blk, normed, cache, cos, sin)
            x = x + h * cfg.residual_scale
            h = self._ffn(i, blk, rms_norm(x, blk.ffn_norm, cfg.rms_eps), k, trace)
            x = x + h * cfg.residual_scale
        cache.end_pass(start + n, n)
        if routing is not None:
            routing.layers = self.moe_layers()
            routing.ids = torch.stack([ids[-1] for ids, _ in trace]) if trace else None
            routing.logits = torch.stack([lg[-1] for _, lg in trace]) if trace else None
        if last_only:
            x = x[-1:]
        logits = self.linear(rms_norm(x, w.output_norm, cfg.rms_eps), w.output)
        return logits / cfg.logit_scale

    def _attention(
        self,
        i: int,
        blk: BlockWeights,
        x: torch.Tensor,
        cache: KVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        n = x.shape[0]
        q = self.linear(x, blk.wq, blk.bq)
        k = self.linear(x, blk.wk, blk.bk)
        v = self.linear(x, blk.wv, blk.bv)
        if cfg.clamp_kqv is not None:
            q, k, v = (t.clamp(-cfg.clamp_kqv, cfg.clamp_kqv) for t in (q, k, v))
        per_head_norm = blk.q_norm is not None and blk.q_norm.numel() == cfg.head_dim
        if blk.q_norm is not None and not per_head_norm:  # olmoe: norm over all heads
            q = rms_norm(q, blk.q_norm, cfg.rms_eps)
            k = rms_norm(k, blk.k_norm, cfg.rms_eps)
        q = q.view(n, cfg.n_head, cfg.head_dim).transpose(0, 1)  # [n_head, n, head_dim]
        k = k.view(n, cfg.n_head_kv, cfg.head_dim).transpose(0, 1)
        v = v.view(n, cfg.n_head_kv, cfg.head_dim).transpose(0, 1)
        if per_head_norm:  # qwen3moe: norm per head
            q = rms_norm(q, blk.q_norm, cfg.rms_eps)
            k = rms_norm(k, blk.k_norm, cfg.rms_eps)
        start = cache.n_tokens
        if not cfg.is_nope(i):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if cfg.qk_l2_norm:  # llama4: per head, no weight
                q, k = rms_norm(q, 1.0, cfg.rms_eps), rms_norm(k, 1.0, cfg.rms_eps)
        elif cfg.temperature_length:  # llama4's NoPE layers
            q = q * temperature_scales(cfg, start, n)[None, :, None]

        end = start + n
        cache.k[i][:, start:end] = k
        cache.v[i][:, start:end] = v
        keys, values = cache.k[i][:, :end], cache.v[i][:, :end]  # [n_head_kv, end, head_dim]
        group = cfg.n_head // cfg.n_head_kv
        if group > 1:
            keys = keys.repeat_interleave(group, dim=0)
            values = values.repeat_interleave(group, dim=0)
        mask = attention_mask(start, end, cfg.layer_window(i), chunk=cfg.layer_chunk(i))
        scale = (
            cfg.attention_scale if cfg.attention_scale is not None else 1 / math.sqrt(cfg.head_dim)
        )
        if blk.sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        else:
            out = sink_attention(q, keys, values, mask, scale, blk.sinks)
        out = out.transpose(0, 1).reshape(n, cfg.n_head * cfg.head_dim)
        if blk.attn_gate is not None:  # qwen35moe: a sigmoid gate per output
            out = out * torch.sigmoid(self.linear(x, blk.attn_gate))
        return self.linear(out, blk.wo, blk.bo)

    def _mla(self, i, blk: BlockWeights, x, cache: KVCache, cos, sin) -> torch.Tensor:
        """Multi-head latent attention (pyruntime.model.mla) over the cache's latents: a prompt
        in the plain form, a decode step absorbed."""
        cfg, w = self.config, blk.mla
        n, start = x.shape[0], cache.n_tokens
        end = start + n
        q_nope, q_pe = mla_query(cfg, w, x, cos, sin, self.linear)
        cache.k[i][0, start:end] = mla_latent(cfg, w, x, cos, sin, self.linear)
        latents, mask = cache.k[i][0, :end], attention_mask(start, end)
        if n == 1:
            heads = self.heads_linear or heads_linear(self.linear)
            out = attention_absorbed(
                cfg, w, q_nope, q_pe, latents, mask, cfg.attention_scale, heads
            )
        else:
            out = attention_plain(cfg, w, q_nope, q_pe, latents, mask, cfg.attention_scale)
        return self.linear(out, blk.wo)

    def _deltanet(self, i: int, blk: BlockWeights, x: torch.Tensor, cache: KVCache):
        """A Gated DeltaNet layer (pyruntime.model.deltanet) on the cache's recurrent state."""
        state = cache.recurrent
        return deltanet_layer(
            self.config, blk.deltanet, x, state.conv[i], state.ssm[i], self.linear
        )

    def _ffn(
        self,
        i: int,
        blk: BlockWeights,
        x: torch.Tensor,
        k: int,
        trace: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """The FFN sub-block of layer i for x [T, n_embd] with k routed experts per token; trace
        gets (ids [T, k], router logits [T, n_expert]) of a MoE layer."""
        cfg = self.config
        if blk.experts is None:
            return dense_ffn(blk.dense_ffn, x, cfg.activation, self.linear)
        logits = self.linear(x, blk.router, blk.router_bias)
        ids, w = route(
            logits,
            k,
            cfg.expert_weights_norm,
            cfg.expert_weights_scale,
            (cfg.expert_groups, cfg.expert_groups_used),
            cfg.expert_input_weight,
        )
        if trace is not None:
            trace.append((ids, logits.float()))
        observe = self.gate_observer
        threshold = None if self.expert_threshold is None else self.expert_threshold[i]
        if cfg.expert_input_weight:  # llama4

            def slot_observer(xs: torch.Tensor, ids_s: torch.Tensor) -> None:
                observe(i, blk.experts, xs, ids_s, cfg.activation)

            y, n_active = input_weighted_experts(
                self.expert_backend, blk.experts, x, ids, w, cfg.activation, threshold,
                None if observe is None else slot_observer,
            )  # fmt: skip
        else:
            if observe is not None:
                observe(i, blk.experts, x, ids, cfg.activation)
            y, n_active = self.expert_backend(blk.experts, x, ids, w, cfg.activation, threshold)
        self.stats.add(n_pairs=ids.numel(), n_active=n_active, n_ff=cfg.n_ff_exp)
        if blk.shared is not None:
            s = dense_ffn(blk.shared, x, cfg.activation, self.linear)
            if blk.shared_gate is not None:
                s = s * torch.sigmoid(x @ blk.shared_gate)[:, None]
            y = y + s
        return y
