"""Model hyper-parameters read from GGUF metadata (docs/gguf-layout.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import GGUFFile
from pyruntime.model.layout import check_layout_keys, check_tensors
from pyruntime.model.llamacpp_layout import EXPERT_WEIGHTS_NORM
from pyruntime.model.rope_scaling import Llama3, Yarn

_REQUIRED = object()  # the default of a key that must be present
SUPPORTED_ARCHS = (
    "olmoe", "qwen2moe", "qwen3moe", "llama", "granitemoe", "gpt-oss", "qwen35moe", "deepseek2",
    "llama4",
)  # fmt: skip
# swiglu_oai: gpt-oss's clamped SwiGLU (its own formula of gate and up: see model/reference.py)
ACTIVATIONS = ("silu", "gelu", "gelu_exact", "swiglu_oai")
ROPE_SCALINGS = ("none", "yarn", "llama3")  # {arch}.rope.scaling.type


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    expert_weights_norm: bool
    activation: str = "silu"
    n_ff_shexp: int = 0
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    logit_scale: float = 1.0
    clamp_kqv: float | None = None
    rope_yarn: Yarn | None = None  # YaRN rope scaling (gpt-oss), None: plain rope
    sliding_window: int = 0  # keys a sliding layer's query sees (itself included); 0: none
    sliding_layers: tuple[bool, ...] = ()  # per layer, True: sliding-window attention
    swiglu_alpha: float = 1.702  # swiglu_oai: g * sigmoid(alpha g)
    swiglu_limit: float = 7.0  # swiglu_oai: gate clamped above, up to [-limit, limit]
    # Gated DeltaNet (qwen35moe): per layer, True for linear attention (no KV cache: a conv
    # state and a recurrent state per sequence); its head counts and sizes, conv kernel length
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    ssm_head_k_dim: int = 0
    ssm_head_v_dim: int = 0
    # llama4: per layer, True for a NoPE layer (no rope, global attention, temperature tuning);
    # the rope layers attend within chunks of attention_chunk tokens (0: no chunking) and
    # L2-normalize q and k per head after rope (qk_l2_norm); a NoPE layer's q is scaled by
    # 1 + temperature_scale log(1 + floor((pos + 1) / temperature_length)) (0: no scaling);
    # routing: top-k of the router logits, sigmoid(logit) multiplies the expert's input
    rope_llama3: Llama3 | None = None
    nope_layers: tuple[bool, ...] = ()
    attention_chunk: int = 0
    qk_l2_norm: bool = False
    temperature_length: int = 0
    temperature_scale: float = 0.0
    expert_input_weight: bool = False
    # Multi-head latent attention (deepseek2; pyruntime.model.mla): the latent's rank (0: not
    # MLA), the query LoRA's rank (0: none), per head the key dims without and with rope and the
    # value dims. head_dim is then the cached latent plus rope key (mla_kv_rank + rope_dim) of
    # the one kv "head".
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_nope_dim: int = 0
    mla_v_dim: int = 0
    # routing (deepseek2): weights times expert_weights_scale; with expert_groups > 0 the top-k
    # is taken within the expert_groups_used best of expert_groups groups of experts
    expert_weights_scale: float = 1.0
    expert_groups: int = 0
    expert_groups_used: int = 0

    def is_nope(self, layer: int) -> bool:
        """Whether `layer` is a NoPE layer (llama4): no rope, attends to every earlier token."""
        return bool(self.nope_layers) and self.nope_layers[layer]

    def layer_chunk(self, layer: int) -> int:
        """Tokens per attention chunk of `layer` (a query sees the keys of its own chunk up to
        itself), 0 when the layer does not chunk."""
        return 0 if self.is_nope(layer) else self.attention_chunk

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_rank > 0

    def is_recurrent(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear attention) layer."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of a DeltaNet layer's conv: its queries, keys and values."""
        return (
            2 * self.ssm_n_k_heads * self.ssm_head_k_dim + self.ssm_n_v_heads * self.ssm_head_v_dim
        )

    def layer_window(self, layer: int) -> int:
        """Keys a query of `layer` attends to, itself included (0: every earlier position)."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelConfig:
        """The hyper-parameters of a file in our layout, each range-checked (ModelFileError
        naming the key) before anything derived from it is computed; then every tensor of the
        file checked against them (model/layout.py), before any executor reads one."""
        check_layout_keys(f)
        if f.arch not in SUPPORTED_ARCHS:
            raise ModelFileError(
                f"{f.path}: architecture {f.arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        g = _Keys(f)
        n_embd = g.int("embedding_length")
        n_head = g.int("attention.head_count")
        head_dim = g.int("attention.key_length", n_embd // n_head or None)
        n_expert = g.int("expert_count")
        cfg = cls(
            arch=f.arch,
            n_vocab=g.int("vocab_size", _rows(f, "token_embd.weight")),
            n_embd=n_embd,
            n_layer=g.int("block_count"),
            n_head=n_head,
            n_head_kv=g.int("attention.head_count_kv", n_head),
            head_dim=head_dim,
            n_expert=n_expert,
            n_expert_used=g.int("expert_used_count"),
            n_ff_exp=g.int("expert_feed_forward_length"),
            context_length=g.int("context_length"),
            rms_eps=g.float("attention.layer_norm_rms_epsilon", positive=True),
            rope_theta=g.float("rope.freq_base", 10000.0, positive=True),
            rope_dim=g.int("rope.dimension_count", head_dim, minimum=0),
            # absent: what llama.cpp's graph does for the family (our converter writes it)
            expert_weights_norm=bool(
                g.get("expert_weights_norm", EXPERT_WEIGHTS_NORM.get(f.arch, False))
            ),
            activation=str(f.get("pyruntime.expert_activation", "silu")),
            n_ff_shexp=g.int("expert_shared_feed_forward_length", 0),
            embedding_scale=g.float("embedding_scale", 1.0),
            residual_scale=g.float("residual_scale", 1.0),
            attention_scale=_attention_scale(f, g),
            logit_scale=g.float("logit_scale", 1.0, positive=True),
            clamp_kqv=g.float("attention.clamp_kqv", None, positive=True),
            rope_yarn=_yarn(f, g),
            rope_llama3=_llama3(g),
            sliding_window=g.int("attention.sliding_window", 0, minimum=0),
            sliding_layers=_sliding_layers(f, g),
            swiglu_alpha=_layout_float(f, "pyruntime.swiglu_alpha", 1.702),
            swiglu_limit=_layout_float(f, "pyruntime.swiglu_limit", 7.0, positive=True),
            **_deltanet(f, g),
            **_mla(f, g),
            **_llama4(f, g),
        )
        value_length = g.int("attention.value_length", head_dim)
        if cfg.is_mla:
            value_length += cfg.rope_dim  # the latent: the cached key's first kv_lora_rank dims
        if value_length != head_dim:
            raise ModelFileError(
                f"{f.path}: {f.arch}.attention.value_length {value_length} differs from "
                f"key_length {head_dim}, which is not supported"
            )
        cfg.validate(str(f.path))
        check_tensors(f, cfg)
        return cfg

    def validate(self, where: str) -> None:
        if self.activation not in ACTIVATIONS:
            raise ModelFileError(f"{where}: unknown expert activation {self.activation!r}")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ModelFileError(
                f"{where}: expert_used_count {self.n_expert_used} not in 1..{self.n_expert}"
            )
        if self.n_head % self.n_head_kv != 0:
            raise ModelFileError(
                f"{where}: head_count {self.n_head} is not a multiple of head_count_kv "
                f"{self.n_head_kv}"
            )
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ModelFileError(f"{where}: bad rope.dimension_count {self.rope_dim}")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layer:
            raise ModelFileError(
                f"{where}: {self.arch}.attention.sliding_window_pattern has "
                f"{len(self.sliding_layers)} entries, expected one per layer ({self.n_layer})"
            )
        if self.recurrent_layers and len(self.recurrent_layers) != self.n_layer:
            raise ModelFileError(
                f"{where}: {self.arch}.attention.recurrent_layers has "
                f"{len(self.recurrent_layers)} entries, expected one per layer ({self.n_layer})"
            )
        if self.nope_layers and len(self.nope_layers) != self.n_layer:
            raise ModelFileError(
                f"{where}: {self.arch}.attention.nope_layers has {len(self.nope_layers)} "
                f"entries, expected one per layer ({self.n_layer})"
            )
        if any(self.sliding_layers) and self.sliding_window < 1:
            raise ModelFileError(
                f"{where}: metadata key '{self.arch}.attention.sliding_window' is missing or 0, "
                "but sliding_window_pattern marks sliding-window layers"
            )


class _Keys:
    """The `{arch}.*` keys of a file, read with range checks. Their GGUF types were checked when
    the file was opened (pyruntime.gguf.keys), so an integer key holds an int here, unless the
    family stores it per layer (a list), which these architectures never do."""

    def __init__(self, f: GGUFFile) -> None:
        self.f = f

    def get(self, suffix: str, default: Any) -> Any:
        return self.f.arch_get(suffix, default)

    def _bad(self, suffix: str, why: str) -> ModelFileError:
        return ModelFileError(f"{self.f.path}: metadata key '{self.f.arch}.{suffix}' {why}")

    def int(self, suffix: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        """An integer in [minimum, 2^31) (the C core's int)."""
        value = self.get(suffix, None)
        if value is None:
            if default is _REQUIRED or default is None:
                raise self._bad(suffix, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(suffix, f"is {_shown(value)}, expected one integer")
        if not minimum <= value < 1 << 31:
            raise self._bad(suffix, f"is {value}, outside [{minimum}, 2^31)")
        return value

    def float(self, suffix: str, default: Any = _REQUIRED, positive: bool = False) -> Any:
        """A finite float (> 0 when `positive`), or `default` (which may be None) when absent."""
        value = self.get(suffix, None)
        if value is None:
            if default is _REQUIRED:
                raise self._bad(suffix, "is missing")
            return default
        if not isinstance(value, float) or not math.isfinite(value) or (positive and value <= 0):
            expected = "a finite float > 0" if positive else "a finite float"
            raise self._bad(suffix, f"is {_shown(value)}, expected {expected}")
        return value


def _yarn(f: GGUFFile, g: _Keys) -> Yarn | None:
    """The rope scaling keys: absent or 'none' (plain rope), or 'yarn' with its parameters."""
    kind = g.get("rope.scaling.type", "none")
    if kind not in ROPE_SCALINGS:
        raise g._bad(
            "rope.scaling.type", f"is {_shown(kind)}; supported: {', '.join(ROPE_SCALINGS)}"
        )
    if kind in ("none", "llama3"):
        return None
    truncate = f.get("pyruntime.rope_yarn_truncate", True)
    return Yarn(
        factor=g.float("rope.scaling.factor", positive=True),
        original_context_length=g.int("rope.scaling.original_context_length"),
        beta_fast=g.float("rope.scaling.yarn_beta_fast", 32.0, positive=True),
        beta_slow=g.float("rope.scaling.yarn_beta_slow", 1.0, positive=True),
        truncate=bool(truncate),
        attn_factor=g.float("rope.scaling.attn_factor", None, positive=True),
    )


def _llama3(g: _Keys) -> Llama3 | None:
    """Llama 3 rope scaling (rope.scaling.type 'llama3'), else None."""
    if g.get("rope.scaling.type", "none") != "llama3":
        return None
    low = g.float("rope.scaling.low_freq_factor", positive=True)
    high = g.float("rope.scaling.high_freq_factor", positive=True)
    if high < low:
        raise g._bad("rope.scaling.high_freq_factor", f"is {high}, below low_freq_factor {low}")
    return Llama3(
        factor=g.float("rope.scaling.factor", positive=True),
        low_freq_factor=low,
        high_freq_factor=high,
        original_context_length=g.int("rope.scaling.original_context_length"),
    )


def _deltanet(f: GGUFFile, g: _Keys) -> dict[str, Any]:
    """The Gated DeltaNet keys of a qwen35moe file (llama.cpp's names): which layers are linear
    attention (attention.recurrent_layers, else every full_attention_interval-th layer is full),
    conv kernel, key heads (group_count) of state_size dims, value heads (time_step_rank) of
    inner_size / time_step_rank dims. {} for the other families."""
    if f.arch != "qwen35moe":
        return {}
    n_layer = g.int("block_count")
    pattern = g.get("attention.recurrent_layers", None)
    if pattern is None:
        interval = g.int("full_attention_interval", 4)
        pattern = [bool((i + 1) % interval) for i in range(n_layer)]
    n_k, n_v = g.int("ssm.group_count"), g.int("ssm.time_step_rank")
    inner = g.int("ssm.inner_size")
    if n_v % n_k or inner % n_v:
        raise g._bad(
            "ssm.time_step_rank",
            f"is {n_v}: it must be a multiple of ssm.group_count {n_k} and divide "
            f"ssm.inner_size {inner}",
        )
    return dict(
        recurrent_layers=tuple(bool(v) for v in pattern),
        ssm_conv_kernel=g.int("ssm.conv_kernel", minimum=2),
        ssm_n_k_heads=n_k,
        ssm_n_v_heads=n_v,
        ssm_head_k_dim=g.int("ssm.state_size"),
        ssm_head_v_dim=inner // n_v,
    )


def _attention_scale(f: GGUFFile, g: _Keys) -> float | None:
    """attention.scale, None when absent (1/sqrt(head_dim)); for deepseek2, absent (llama.cpp's
    files): key_length_mla^-0.5 times YaRN's (1 + yarn_log_multiplier ln(factor))^2."""
    scale = g.float("attention.scale", None, positive=True)
    if scale is not None or f.arch != "deepseek2":
        return scale
    scale = g.int("attention.key_length_mla") ** -0.5
    yarn = _yarn(f, g)
    log_mul = g.float("rope.scaling.yarn_log_multiplier", 0.0)
    if yarn is not None and yarn.factor > 1:
        scale *= (1 + log_mul * math.log(yarn.factor)) ** 2
    return scale


def _mla(f: GGUFFile, g: _Keys) -> dict[str, Any]:
    """The multi-head latent attention and routing keys of a deepseek2 file (llama.cpp's names:
    attention.kv_lora_rank, q_lora_rank, key_length_mla / value_length_mla, expert_weights_scale,
    expert_group_count / expert_group_used_count). {} for the other families."""
    if f.arch != "deepseek2":
        return {}
    rank = g.int("attention.kv_lora_rank")
    rope = g.int("rope.dimension_count")
    key_length = g.int("attention.key_length")
    if key_length != rank + rope:
        raise g._bad(
            "attention.key_length",
            f"is {key_length}; MLA caches kv_lora_rank {rank} + rope.dimension_count {rope} dims",
        )
    qk = g.int("attention.key_length_mla")
    if qk <= rope:
        raise g._bad("attention.key_length_mla", f"is {qk}, not more than its {rope} rope dims")
    n_expert = g.int("expert_count")
    groups = g.int("expert_group_count", 0, minimum=0)
    used = g.int("expert_group_used_count", groups, minimum=0)
    k = g.int("expert_used_count")
    if groups > 1 and (
        n_expert % groups or not 1 <= used <= groups or used * (n_expert // groups) < k
    ):
        raise g._bad(
            "expert_group_count",
            f"is {groups}: it must divide expert_count {n_expert} and be >= "
            f"expert_group_used_count {used} >= 1, whose groups must hold {k} experts",
        )
    return dict(
        mla_kv_rank=rank,
        mla_q_rank=g.int("attention.q_lora_rank", 0, minimum=0),
        mla_nope_dim=qk - rope,
        mla_v_dim=g.int("attention.value_length_mla"),
        expert_weights_scale=g.float("expert_weights_scale", 1.0, positive=True),
        expert_groups=groups if groups > 1 else 0,
        expert_groups_used=used if groups > 1 else 0,
    )


def _llama4(f: GGUFFile, g: _Keys) -> dict[str, Any]:
    """The llama4 keys: NoPE layers, attention chunk, q/k L2 norm, temperature tuning, routing
    (docs/gguf-layout.md). {} for the other families."""
    if f.arch != "llama4":
        return {}
    pattern = g.get("attention.nope_layers", None)
    length = g.int("attention.temperature_length", 0, minimum=0)
    return dict(
        nope_layers=() if pattern is None else tuple(bool(v) for v in pattern),
        attention_chunk=g.int("attention.chunk_size", 0, minimum=0),
        qk_l2_norm=bool(g.get("attention.qk_l2_norm", False)),
        temperature_length=length,
        temperature_scale=g.float("attention.temperature_scale", 0.0) if length else 0.0,
        expert_input_weight=True,
    )


def _sliding_layers(f: GGUFFile, g: _Keys) -> tuple[bool, ...]:
    """{arch}.attention.sliding_window_pattern: per layer, True for sliding-window attention."""
    pattern = g.get("attention.sliding_window_pattern", None)
    return () if pattern is None else tuple(bool(v) for v in pattern)


def _layout_float(f: GGUFFile, key: str, default: float, positive: bool = False) -> float:
    """A finite float key of the layout (pyruntime.*), its type checked by layout.py."""
    value = f.get(key, default)
    if not math.isfinite(value) or (positive and value <= 0):
        expected = "a finite float > 0" if positive else "a finite float"
        raise ModelFileError(
            f"{f.path}: metadata key '{key}' is {_shown(value)}, expected {expected}"
        )
    return value


def _rows(f: GGUFFile, name: str) -> int | None:
    """Rows of a tensor (its outermost dimension), or None for a scalar or an empty one."""
    shape = f.tensor(name).shape
    return shape[0] or None if shape else None


def _shown(value: Any) -> str:
    """A value for an error line: short and on one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
