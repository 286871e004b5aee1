"""The MoE decoder shared by every supported family (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral,
Granite-MoE), on the CPU with torch.

Per block: RMSNorm -> attention (GQA, optional q/k norm, RoPE "rotate_half", KV cache)
-> residual -> RMSNorm -> router (softmax, top-k) -> routed experts (+ shared expert) -> residual.
Family differences are data, not code: optional tensors (biases, q/k norms, shared expert) and
scalars from the GGUF metadata (scales, renormalization, activation).

Weight matrices (attention, routers, shared experts, embeddings, output) stay in the mmap in their
stored format (QuantMatrix): with the C core they are read in place (CpuCore.linear for prefill,
the whole-block decode step of cpu_decode.py for one token); the torch reference dequantizes them
where it uses them. Norms and biases (small, always F32) are copied to tensors. Routed experts stay
in the mmap (ExpertStore) and are read per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyruntime.dequant import QuantMatrix, dequantize
from pyruntime.errors import ModelFileError, UsageError
from pyruntime.experts.compute import activation_fn, make_expert_backend, moe_ffn_torch, route
from pyruntime.experts.store import ExpertStore
from pyruntime.gguf_file import GGUFFile
from pyruntime.models.config import ModelConfig

# ---------------------------------------------------------------------------------------------
# Weights


@dataclass
class FFNWeights:
    """A dense gated FFN: gate/up [n_ff, n_embd], down [n_embd, n_ff]."""

    gate: QuantMatrix
    up: QuantMatrix
    down: QuantMatrix


@dataclass
class BlockWeights:
    attn_norm: torch.Tensor  # [n_embd]
    wq: QuantMatrix  # [n_head*head_dim, n_embd]
    wk: QuantMatrix  # [n_head_kv*head_dim, n_embd]
    wv: QuantMatrix  # [n_head_kv*head_dim, n_embd]
    wo: QuantMatrix  # [n_embd, n_head*head_dim]
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None  # olmoe [n_head*head_dim]; qwen3moe [head_dim]
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor  # [n_embd]
    router: QuantMatrix | None  # [n_expert, n_embd] (F32); None for a dense FFN layer
    experts: ExpertStore | None
    shared: FFNWeights | None  # shared expert (qwen2moe)
    shared_gate: torch.Tensor | None  # [n_embd]: shared output *= sigmoid(x . shared_gate)
    dense_ffn: FFNWeights | None  # dense FFN layer (qwen mlp_only_layers)


def _load(f: GGUFFile, name: str) -> torch.Tensor:
    """A small F32 tensor (norm, bias, gate vector), copied out of the mmap."""
    t = f.tensor(name)
    return dequantize(t.data, t.qtype, t.shape)


def _matrix(f: GGUFFile, name: str) -> QuantMatrix:
    """A weight matrix, left in the mmap in its stored format."""
    t = f.tensor(name)
    if len(t.shape) != 2:
        raise ModelFileError(f"{f.path}: tensor '{name}' has shape {list(t.shape)}, expected 2-D")
    return QuantMatrix(name, t.qtype, (int(t.shape[0]), int(t.shape[1])), t.data)


def _load_opt(f: GGUFFile, name: str) -> torch.Tensor | None:
    return _load(f, name) if f.has_tensor(name) else None


def _load_ffn(f: GGUFFile, prefix: str, suffix: str) -> FFNWeights | None:
    if not f.has_tensor(f"{prefix}.ffn_gate{suffix}.weight"):
        return None
    return FFNWeights(
        gate=_matrix(f, f"{prefix}.ffn_gate{suffix}.weight"),
        up=_matrix(f, f"{prefix}.ffn_up{suffix}.weight"),
        down=_matrix(f, f"{prefix}.ffn_down{suffix}.weight"),
    )


def _load_block(f: GGUFFile, cfg: ModelConfig, i: int) -> BlockWeights:
    p = f"blk.{i}"
    has_experts = f.has_tensor(f"{p}.ffn_gud_exps.weight")
    shared_gate = _load_opt(f, f"{p}.ffn_gate_inp_shexp.weight")
    return BlockWeights(
        attn_norm=_load(f, f"{p}.attn_norm.weight"),
        wq=_matrix(f, f"{p}.attn_q.weight"),
        wk=_matrix(f, f"{p}.attn_k.weight"),
        wv=_matrix(f, f"{p}.attn_v.weight"),
        wo=_matrix(f, f"{p}.attn_output.weight"),
        bq=_load_opt(f, f"{p}.attn_q.bias"),
        bk=_load_opt(f, f"{p}.attn_k.bias"),
        bv=_load_opt(f, f"{p}.attn_v.bias"),
        q_norm=_load_opt(f, f"{p}.attn_q_norm.weight"),
        k_norm=_load_opt(f, f"{p}.attn_k_norm.weight"),
        ffn_norm=_load(f, f"{p}.ffn_norm.weight"),
        router=_matrix(f, f"{p}.ffn_gate_inp.weight") if has_experts else None,
        experts=ExpertStore.from_tensor(
            f.tensor(f"{p}.ffn_gud_exps.weight"), cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        )
        if has_experts
        else None,
        shared=_load_ffn(f, p, "_shexp"),
        shared_gate=None if shared_gate is None else shared_gate.reshape(-1),
        dense_ffn=None if has_experts else _load_ffn(f, p, ""),
    )


# ---------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Keys and values of past positions, per layer: [n_head_kv, max_tokens, head_dim] float32.

    Storage grows in chunks as tokens arrive, so a large max_tokens costs nothing up front.
    """

    _CHUNK = 256

    def __init__(self, cfg: ModelConfig, max_tokens: int) -> None:
        if max_tokens < 1:
            raise UsageError(f"context size must be at least 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.n_tokens = 0
        self._shape = (cfg.n_head_kv, 0, cfg.head_dim)
        self.k = [torch.empty(self._shape) for _ in range(cfg.n_layer)]
        self.v = [torch.empty(self._shape) for _ in range(cfg.n_layer)]
        self.c_pointers = None

    def truncate(self, n: int) -> None:
        """Forget positions >= n (keeps a common prefix for reuse)."""
        self.n_tokens = max(0, min(n, self.n_tokens))

    def reserve(self, n_new: int) -> None:
        need = self.n_tokens + n_new
        if need > self.max_tokens:
            raise UsageError(
                f"context is full: {self.n_tokens} tokens cached + {n_new} new > context size "
                f"{self.max_tokens} (raise --ctx-size / n_ctx, or start a new conversation)"
            )
        have = self.k[0].shape[1]
        if need <= have:
            return
        self.c_pointers = None  # the C decode step's view of the storage (cpu_decode.py)
        grow = min(self.max_tokens, max(need, have + self._CHUNK)) - have
        for layer in range(len(self.k)):
            pad = torch.zeros(self._shape[0], grow, self._shape[2])
            self.k[layer] = torch.cat([self.k[layer], pad], dim=1)
            self.v[layer] = torch.cat([self.v[layer], pad.clone()], dim=1)


# ---------------------------------------------------------------------------------------------
# Math


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(
    positions: torch.Tensor, dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n, dim] for HF's rotate_half convention (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


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


class MoETransformer:
    """Forward pass with a KV cache. `forward` returns float32 logits [n_tokens, n_vocab]."""

    def __init__(self, cfg: ModelConfig, f: GGUFFile) -> None:
        self.config = cfg
        self.token_embd = _matrix(f, "token_embd.weight")  # [n_vocab, n_embd]
        self.output_norm = _load(f, "output_norm.weight")
        tied = not f.has_tensor("output.weight")
        self.output = self.token_embd if tied else _matrix(f, "output.weight")  # [n_vocab, n_embd]
        self.blocks = [_load_block(f, cfg, i) for i in range(cfg.n_layer)]
        # Routed-expert backend: (store, x, ids, w, act, threshold) -> (y, n_active).
        self.expert_backend = moe_ffn_torch
        self.expert_threshold: list[float] | None = None  # per layer, for neuron sparsity
        # Calibration hook: (layer, store, x [T, n_embd], ids [T, K], activation) -> None.
        self.gate_observer = None
        self.stats = ExpertStats()
        # The C core (pyruntime.cpu_core.CpuCore) when routed experts run on it: then the dense
        # matrices run on it too, and a one-token forward is one C call per token (cpu_decode).
        self.core = None
        self._decoder = None

    def use_core(self, core) -> None:
        """Compute dense matrices and one-token decode steps on `core` (a CpuCore)."""
        from pyruntime.models.cpu_decode import CpuDecoder

        self.core = core
        self._decoder = CpuDecoder(self, core)
        # One thread pool for everything: torch only runs the few ops left on the prefill path
        # (attention, norms), and its threads would otherwise compete with the pool's.
        torch.set_num_threads(1)

    def linear(self, x: torch.Tensor, w: QuantMatrix, bias: torch.Tensor | None = None):
        """x [T, n_in] -> [T, n_out]: on the C core in w's own format, else torch (dequantized)."""
        if self.core is None:
            return torch_linear(x, w, bias)
        return self.core.linear(w.raw, int(w.qtype), w.shape[0], w.shape[1], x, bias)

    @classmethod
    def from_gguf(
        cls, f: GGUFFile, threads: int | None = None, expert_backend: str = "auto"
    ) -> MoETransformer:
        """expert_backend: 'auto' (C core when built), 'c' or 'torch' (the reference)."""
        if threads is not None:
            if threads < 1:
                raise UsageError(f"--threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        model = cls(ModelConfig.from_gguf(f), f)
        model.expert_backend = make_expert_backend(expert_backend, threads)
        core = getattr(model.expert_backend, "core", None)
        if core is not None:
            model.use_core(core)
        return model

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(self.config, max_tokens)

    def forward(
        self, tokens: Sequence[int] | torch.Tensor, cache: KVCache, last_only: bool = False
    ) -> torch.Tensor:
        """Logits [n_tokens, n_vocab] (or [1, n_vocab] with last_only) float32."""
        if self._decoder is not None and self.gate_observer is None:
            token = single_token(tokens, self.config.n_vocab)
            if token is not None:  # decode: one C call, no torch op (~15 us of Python)
                cache.reserve(1)
                return self._decoder.step(token, cache)  # [1, n_vocab]
        return self._forward_torch(tokens, cache, last_only)

    @torch.inference_mode()
    def _forward_torch(
        self, tokens: Sequence[int] | torch.Tensor, cache: KVCache, last_only: bool
    ) -> torch.Tensor:
        cfg = self.config
        ids = token_ids(tokens, cfg.n_vocab)
        n = ids.numel()
        cache.reserve(n)
        start = cache.n_tokens
        cos, sin = rope_tables(torch.arange(start, start + n), cfg.rope_dim, cfg.rope_theta)
        x = self.token_embd.rows(ids) * cfg.embedding_scale  # [n, n_embd]
        for i, blk in enumerate(self.blocks):
            h = self._attention(i, blk, rms_norm(x, blk.attn_norm, cfg.rms_eps), cache, cos, sin)
            x = x + h * cfg.residual_scale
            h = self._ffn(i, blk, rms_norm(x, blk.ffn_norm, cfg.rms_eps))
            x = x + h * cfg.residual_scale
        cache.n_tokens = start + n
        if last_only:
            x = x[-1:]
        logits = self.linear(rms_norm(x, self.output_norm, cfg.rms_eps), self.output)
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        start = cache.n_tokens
        end = start + n
        cache.k[i][:, start:end] = k
        cache.v[i][:, start:end] = v
        keys, values = cache.k[i][:, :end], cache.v[i][:, :end]  # [n_head_kv, end, head_dim]
        group = cfg.n_head // cfg.n_head_kv
        if group > 1:
            keys = keys.repeat_interleave(group, dim=0)
            values = values.repeat_interleave(group, dim=0)
        # Causal mask over absolute positions: query at start+a sees keys 0..start+a.
        q_pos = torch.arange(start, end)[:, None]
        mask = torch.arange(end)[None, :] <= q_pos  # [n, end] bool
        scale = (
            cfg.attention_scale if cfg.attention_scale is not None else 1 / math.sqrt(cfg.head_dim)
        )
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return self.linear(out.transpose(0, 1).reshape(n, cfg.n_head * cfg.head_dim), blk.wo)

    def _ffn(self, i: int, blk: BlockWeights, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if blk.experts is None:
            return dense_ffn(blk.dense_ffn, x, cfg.activation, self.linear)
        ids, w = route(self.linear(x, blk.router), cfg.n_expert_used, cfg.expert_weights_norm)
        if self.gate_observer is not None:
            self.gate_observer(i, blk.experts, x, ids, cfg.activation)
        threshold = None if self.expert_threshold is None else self.expert_threshold[i]
        y, n_active = self.expert_backend(blk.experts, x, ids, w, cfg.activation, threshold)
        self.stats.add(n_pairs=ids.numel(), n_active=n_active, n_ff=cfg.n_ff_exp)
        if blk.shared is not None:
            s = dense_ffn(blk.shared, x, cfg.activation, self.linear)
            if blk.shared_gate is not None:
                s = s * torch.sigmoid(x @ blk.shared_gate)[:, None]
            y = y + s
        return y


def token_ids(tokens: Sequence[int] | torch.Tensor, n_vocab: int) -> torch.Tensor:
    """tokens as a flat int64 tensor [n], n >= 1, every id in [0, n_vocab) (else UsageError)."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise UsageError("forward() needs at least one token")
    if int(ids.min()) < 0 or int(ids.max()) >= n_vocab:
        raise UsageError(f"token id out of range [0, {n_vocab})")
    return ids


def single_token(tokens: Sequence[int] | torch.Tensor, n_vocab: int) -> int | None:
    """The token id when `tokens` holds exactly one (in [0, n_vocab), else UsageError as
    token_ids), else None: the decode fast paths' check, without building a tensor."""
    if isinstance(tokens, torch.Tensor):
        token = int(tokens.reshape(-1)[0]) if tokens.numel() == 1 else None
    elif len(tokens) == 1 and not isinstance(tokens[0], torch.Tensor | Sequence):
        token = int(tokens[0])
    else:
        return None
    if token is not None and not 0 <= token < n_vocab:
        raise UsageError(f"token id out of range [0, {n_vocab})")
    return token


@dataclass
class ExpertStats:
    """Counts of routed-expert work, to report achieved neuron sparsity."""

    pairs: int = 0  # (token, expert) computations
    neurons: int = 0  # pairs * n_ff
    active: int = 0  # neurons whose up/down rows were used

    def add(self, n_pairs: int, n_active: int, n_ff: int) -> None:
        self.pairs += n_pairs
        self.neurons += n_pairs * n_ff
        self.active += n_active

    @property
    def sparsity(self) -> float:
        return 0.0 if self.neurons == 0 else 1.0 - self.active / self.neurons

    def reset(self) -> None:
        self.pairs = self.neurons = self.active = 0
