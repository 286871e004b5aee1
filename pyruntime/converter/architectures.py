"""The supported HF architectures, one registered class each (see base.MoeModel for the hooks)."""

from __future__ import annotations

from gguf import GGUFWriter

from pyruntime.converter.base import MoeModel, register
from pyruntime.converter.tensors import OutTensor


@register("OlmoeForCausalLM")
class OlmoeModel(MoeModel):
    """OLMoE: q/k RMSNorm over the whole projection (not per head), no shared expert."""

    gguf_arch = "olmoe"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.hp.config.get("clip_qkv") is not None:
            raise self.hp._bad("clip_qkv", "must be null (q/k/v clamping is not supported)")

    def qk_norm_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.n_head * self.head_dim,), (self.n_head_kv * self.head_dim,)


class _QwenMoeModel(MoeModel):
    """Shared by Qwen2-MoE and Qwen3-MoE: dense layers from mlp_only_layers/decoder_sparse_step."""

    n_ff_exp_key = "moe_intermediate_size"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.hp.bool("use_sliding_window", False):
            raise self.hp._bad("use_sliding_window", "true is not supported (full attention only)")

    def is_moe_layer(self, i: int) -> bool:
        # transformers: Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer
        step = self.hp.int("decoder_sparse_step", default=1)
        return i not in self.hp.int_list("mlp_only_layers") and (i + 1) % step == 0


@register("Qwen2MoeForCausalLM")
class Qwen2MoeModel(_QwenMoeModel):
    """Qwen2-MoE: q/k/v biases and a shared expert scaled by sigmoid(shared_expert_gate . x)."""

    gguf_arch = "qwen2moe"

    def has_qkv_bias(self) -> bool:
        return self.hp.bool("qkv_bias", True)  # absent in older configs, which always had biases

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        super().set_gguf_parameters(w)
        n_ff_shexp = self.hp.int("shared_expert_intermediate_size")
        w.add_uint32(f"{self.gguf_arch}.expert_shared_feed_forward_length", n_ff_shexp)

    def ffn_tensors(self, i: int) -> list[OutTensor]:
        out = super().ffn_tensors(i)
        if not self.is_moe_layer(i):
            return out
        n_ff_shexp = self.hp.int("shared_expert_intermediate_size")
        out += self.dense_ffn(i, "mlp.shared_expert", "_shexp", n_ff_shexp)
        gate = self.src.claim(f"model.layers.{i}.mlp.shared_expert_gate.weight", (1, self.n_embd))
        # HF Linear(n_embd -> 1) weight [1, n_embd], written as a vector [n_embd]
        out.append(
            self._from_source(f"blk.{i}.ffn_gate_inp_shexp.weight", gate, (self.n_embd,), "f32")
        )
        return out


@register("Qwen3MoeForCausalLM")
class Qwen3MoeModel(_QwenMoeModel):
    """Qwen3-MoE: per-head q/k RMSNorm of size head_dim, no biases, no shared expert."""

    gguf_arch = "qwen3moe"

    def qk_norm_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.head_dim,), (self.head_dim,)


@register("MixtralForCausalLM")
class MixtralModel(MoeModel):
    """Mixtral: llama arch string; experts w1 (gate), w3 (up), w2 (down) under block_sparse_moe
    on disk (transformers 5 saves them so), or `mlp.experts.*` as transformers 5 holds them."""

    gguf_arch = "llama"
    n_expert_keys = ("num_local_experts",)
    moe_prefixes = ("block_sparse_moe", "mlp")
    per_expert_names = (
        ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
        *MoeModel.per_expert_names,
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        window = self.hp.config.get("sliding_window")
        if window is not None and window < self.hp.int("max_position_embeddings"):
            raise self.hp._bad(
                "sliding_window", "is set; sliding-window attention is not supported"
            )

    def expert_weights_norm(self) -> bool:
        return True  # softmax over the top-k logits == renormalized top-k of the full softmax


@register("GraniteMoeForCausalLM")
class GraniteMoeModel(MoeModel):
    """Granite-MoE: fused experts (input_linear = gate;up, output_linear = down), and four scalar
    multipliers (embedding, residual, attention softmax scale, logits divisor)."""

    gguf_arch = "granitemoe"
    n_expert_keys = ("num_local_experts",)
    moe_prefixes = ("block_sparse_moe",)
    router_names = ("router.layer.weight", "router.weight")
    fused_names = (
        ("input_linear.weight", "output_linear.weight"),
        ("experts.gate_up_proj", "experts.down_proj"),
    )

    def expert_weights_norm(self) -> bool:
        return True  # GraniteMoeTopKRouter: softmax over the top-k logits

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        super().set_gguf_parameters(w)
        a, hp = self.gguf_arch, self.hp
        w.add_float32(f"{a}.embedding_scale", hp.float("embedding_multiplier", 1.0))
        w.add_float32(f"{a}.residual_scale", hp.float("residual_multiplier", 1.0))
        w.add_float32(f"{a}.attention.scale", hp.float("attention_multiplier", 1.0))
        w.add_float32(f"{a}.logit_scale", hp.float("logits_scaling", 1.0))
