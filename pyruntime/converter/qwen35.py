"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, and the text model of
`Qwen3_5MoeForConditionalGeneration`): a hybrid of Gated DeltaNet and full attention.

What differs from the shared MoeModel mapping (transformers' modeling_qwen3_5_moe.py):
- `layer_types` (default: every `full_attention_interval`-th layer full, the rest linear): a
  linear-attention layer (Gated DeltaNet) has `linear_attn.{in_proj_qkv, in_proj_z, in_proj_a,
  in_proj_b, conv1d, A_log, dt_bias, norm, out_proj}` instead of `self_attn.*`;
- full attention: `q_proj` holds per head the query and an output gate ([q_h; gate_h], head_dim
  rows each), split here into attn_q and attn_gate; per-head q/k RMSNorm; rope on the first
  `partial_rotary_factor * head_dim` dims of a head (rope.dimension_count);
- every RMSNorm but the DeltaNet's gated one computes `x_hat * (1 + w)`: written as `1 + w`
  (as llama.cpp does), so the runtime's `x_hat * w` is the same math;
- A_log is written as A = -exp(A_log) (llama.cpp's ssm_a), the conv1d weight [C, 1, K] as [C, K];
- a shared expert in every layer, scaled by sigmoid(shared_expert_gate . x);
- a multimodal checkpoint stores the text model under `model.language_model.` and its config
  under `text_config`; the vision tower (`model.visual.`) and the multi-token-prediction head
  (`mtp.`) are not converted. Interleaved MRoPE (`mrope_section`) rotates every section by the
  same position for text, which is plain rope.
The value heads of a DeltaNet layer stay in the checkpoint's order (head h reads key head
h // (n_v_heads / n_k_heads)); llama.cpp's converter tiles them instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf import GGUFWriter

from pyruntime.converter.base import MoeModel, register
from pyruntime.converter.hparams import HParams
from pyruntime.converter.sources import SourceTensors
from pyruntime.converter.tensors import Kind, OutTensor

LINEAR, FULL = "linear_attention", "full_attention"


def text_hparams(hp: HParams) -> HParams:
    """The text model's config: `text_config` over the top level of a multimodal config."""
    text = hp.config.get("text_config")
    if text is None:
        return hp
    if not isinstance(text, dict):
        raise hp._bad("text_config", f"must be an object, got {type(text).__name__}")
    top = {k: v for k, v in hp.config.items() if k not in ("text_config", "vision_config")}
    return HParams({**top, **text}, hp.path)


@register("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
class Qwen35MoeModel(MoeModel):
    gguf_arch = "qwen35moe"
    n_ff_exp_key = "moe_intermediate_size"
    partial_rotary_ok = True

    def __init__(self, hp: HParams, src: SourceTensors, hf_arch: str) -> None:
        src.rename_prefix("model.language_model.", "model.")
        src.skip_prefix("model.visual.")
        src.skip_prefix("mtp.")
        super().__init__(text_hparams(hp), src, hf_arch)
        hp = self.hp
        if self.activation != "silu":
            raise hp._bad("hidden_act", "must be silu (the DeltaNet's conv and gated norm use it)")
        interval = hp.int("full_attention_interval", default=4)
        types = hp.config.get("layer_types") or [
            LINEAR if (i + 1) % interval else FULL for i in range(self.n_layer)
        ]  # Qwen3_5MoeTextConfig's default
        if not isinstance(types, list) or len(types) != self.n_layer or set(types) - {LINEAR, FULL}:
            raise hp._bad(
                "layer_types",
                f"must list '{LINEAR}' or '{FULL}' for each of the {self.n_layer} layers",
            )
        self.linear_layers = [t == LINEAR for t in types]
        self.conv_kernel = hp.int("linear_conv_kernel_dim", default=4, minimum=2)
        self.n_k_heads = hp.int("linear_num_key_heads")
        self.n_v_heads = hp.int("linear_num_value_heads")
        self.head_k_dim = hp.int("linear_key_head_dim")
        self.head_v_dim = hp.int("linear_value_head_dim")
        if self.n_v_heads % self.n_k_heads:
            raise hp._bad(
                "linear_num_value_heads",
                f"must be a multiple of linear_num_key_heads {self.n_k_heads}",
            )
        self.n_ff_shexp = hp.int("shared_expert_intermediate_size")
        self.rope_dim = int(self.head_dim * hp.partial_rotary_factor())
        if self.rope_dim % 2 or self.rope_dim < 2:
            raise hp._bad(
                "partial_rotary_factor",
                f"gives {self.rope_dim} rotated dims of head_dim {self.head_dim}; must be even",
            )

    def expert_weights_norm(self) -> bool:
        return True  # Qwen3_5MoeTopKRouter renormalizes the top-k

    def qk_norm_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.head_dim,), (self.head_dim,)

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        super().set_gguf_parameters(w)
        a = self.gguf_arch
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", self.n_ff_shexp)
        w.add_array(f"{a}.attention.recurrent_layers", self.linear_layers)
        interval = self.hp.int("full_attention_interval", default=4)
        if self.linear_layers == [bool((i + 1) % interval) for i in range(self.n_layer)]:
            w.add_uint32(f"{a}.full_attention_interval", interval)  # llama.cpp's default path
        w.add_uint32(f"{a}.ssm.conv_kernel", self.conv_kernel)
        w.add_uint32(f"{a}.ssm.state_size", self.head_k_dim)
        w.add_uint32(f"{a}.ssm.group_count", self.n_k_heads)
        w.add_uint32(f"{a}.ssm.time_step_rank", self.n_v_heads)
        w.add_uint32(f"{a}.ssm.inner_size", self.n_v_heads * self.head_v_dim)

    # ---- tensors ----

    def copy(self, out: str, hf: str, shape: tuple[int, ...], kind: Kind = "weight") -> OutTensor:
        """As MoeModel.copy; a zero-centred RMSNorm weight w is written as 1 + w."""
        if not out.endswith("norm.weight"):
            return super().copy(out, hf, shape, kind)
        self.src.claim(hf, shape)
        return OutTensor(out, shape, kind, lambda: iter([self.src.load(hf).reshape(shape) + 1]))

    def attention_tensors(self, i: int) -> list[OutTensor]:
        if not self.linear_layers[i]:
            return self._full_attention(i)
        hf, blk, n = f"model.layers.{i}.linear_attn", f"blk.{i}", self.n_embd
        C, K, Hv = self.conv_channels, self.conv_kernel, self.n_v_heads
        v_dim = Hv * self.head_v_dim
        layer = f"model.layers.{i}"
        return [
            self.copy(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (n,), "f32"),
            self.copy(f"{blk}.attn_qkv.weight", f"{hf}.in_proj_qkv.weight", (C, n)),
            self.copy(f"{blk}.attn_gate.weight", f"{hf}.in_proj_z.weight", (v_dim, n)),
            self.copy(f"{blk}.ssm_beta.weight", f"{hf}.in_proj_b.weight", (Hv, n)),
            self.copy(f"{blk}.ssm_alpha.weight", f"{hf}.in_proj_a.weight", (Hv, n)),
            self._reshaped(f"{blk}.ssm_conv1d.weight", f"{hf}.conv1d.weight", (C, 1, K), (C, K)),
            self.copy(f"{blk}.ssm_dt.bias", f"{hf}.dt_bias", (Hv,), "f32"),
            self._a(f"{blk}.ssm_a", f"{hf}.A_log"),
            super().copy(f"{blk}.ssm_norm.weight", f"{hf}.norm.weight", (self.head_v_dim,), "f32"),
            self.copy(f"{blk}.ssm_out.weight", f"{hf}.out_proj.weight", (n, v_dim)),
            self.copy(
                f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (n,), "f32"
            ),
        ]

    def _full_attention(self, i: int) -> list[OutTensor]:
        """q_proj [n_head * 2 head_dim, n] split into attn_q and attn_gate (per head: head_dim
        query rows, then head_dim gate rows); k, v, o and the per-head q/k norms as the base."""
        hf, blk, n = f"model.layers.{i}.self_attn", f"blk.{i}", self.n_embd
        q_rows, kv_rows = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        q_proj = self.src.claim(f"{hf}.q_proj.weight", (2 * q_rows, n))
        fused = (self.n_head, 2, self.head_dim, n)

        def half(part: int) -> Iterator[np.ndarray]:
            yield self.src.load(q_proj).reshape(fused)[:, part].reshape(q_rows, n)

        layer, hd = f"model.layers.{i}", (self.head_dim,)
        return [
            self.copy(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (n,), "f32"),
            OutTensor(f"{blk}.attn_q.weight", (q_rows, n), "weight", lambda: half(0)),
            OutTensor(f"{blk}.attn_gate.weight", (q_rows, n), "weight", lambda: half(1)),
            self.copy(f"{blk}.attn_k.weight", f"{hf}.k_proj.weight", (kv_rows, n)),
            self.copy(f"{blk}.attn_v.weight", f"{hf}.v_proj.weight", (kv_rows, n)),
            self.copy(f"{blk}.attn_output.weight", f"{hf}.o_proj.weight", (n, q_rows)),
            self.copy(f"{blk}.attn_q_norm.weight", f"{hf}.q_norm.weight", hd, "f32"),
            self.copy(f"{blk}.attn_k_norm.weight", f"{hf}.k_norm.weight", hd, "f32"),
            self.copy(
                f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (n,), "f32"
            ),
        ]

    def _reshaped(
        self, out: str, hf: str, shape: tuple[int, ...], out_shape: tuple[int, ...]
    ) -> OutTensor:
        self.src.claim(hf, shape)
        return self._from_source(out, hf, out_shape, "f32")

    def _a(self, out: str, hf: str) -> OutTensor:
        """A = -exp(A_log) [n_v_heads]: the per-head decay rate (g = A softplus(a + dt_bias))."""
        self.src.claim(hf, (self.n_v_heads,))
        return OutTensor(out, (self.n_v_heads,), "f32", lambda: iter([-np.exp(self.src.load(hf))]))

    def ffn_tensors(self, i: int) -> list[OutTensor]:
        out = super().ffn_tensors(i)
        out += self.dense_ffn(i, "mlp.shared_expert", "_shexp", self.n_ff_shexp)
        gate = self.src.claim(f"model.layers.{i}.mlp.shared_expert_gate.weight", (1, self.n_embd))
        # HF Linear(n_embd -> 1) weight [1, n_embd], written as a vector [n_embd]
        out.append(
            self._from_source(f"blk.{i}.ffn_gate_inp_shexp.weight", gate, (self.n_embd,), "f32")
        )
        return out
