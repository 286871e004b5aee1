"""Model hyper-parameters read from GGUF metadata (docs/gguf-layout.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import GGUFFile

SUPPORTED_ARCHS = ("olmoe", "qwen2moe", "qwen3moe", "llama", "granitemoe")
ACTIVATIONS = ("silu", "gelu", "gelu_exact")


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

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelConfig:
        if f.arch not in SUPPORTED_ARCHS:
            raise ModelFileError(
                f"{f.path}: architecture '{f.arch}' is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        g = f.arch_get
        n_embd = int(g("embedding_length"))
        n_head = int(g("attention.head_count"))
        head_dim = int(g("attention.key_length", n_embd // n_head))
        token_embd = f.tensor("token_embd.weight")
        cfg = cls(
            arch=f.arch,
            n_vocab=int(g("vocab_size", token_embd.shape[0])),
            n_embd=n_embd,
            n_layer=int(g("block_count")),
            n_head=n_head,
            n_head_kv=int(g("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_expert=int(g("expert_count")),
            n_expert_used=int(g("expert_used_count")),
            n_ff_exp=int(g("expert_feed_forward_length")),
            context_length=int(g("context_length")),
            rms_eps=float(g("attention.layer_norm_rms_epsilon")),
            rope_theta=float(g("rope.freq_base", 10000.0)),
            rope_dim=int(g("rope.dimension_count", head_dim)),
            expert_weights_norm=bool(g("expert_weights_norm", False)),
            activation=str(f.get("pyruntime.expert_activation", "silu")),
            n_ff_shexp=int(g("expert_shared_feed_forward_length", 0)),
            embedding_scale=float(g("embedding_scale", 1.0)),
            residual_scale=float(g("residual_scale", 1.0)),
            attention_scale=_opt_float(g("attention.scale", None)),
            logit_scale=float(g("logit_scale", 1.0)),
            clamp_kqv=_opt_float(g("attention.clamp_kqv", None)),
        )
        cfg.validate(str(f.path))
        return cfg

    def validate(self, where: str) -> None:
        if self.activation not in ACTIVATIONS:
            raise ModelFileError(f"{where}: unknown expert activation '{self.activation}'")
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


def _opt_float(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]
