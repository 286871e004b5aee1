"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: deepseek-v2, deepseek-v2-lite and their chat models):
multi-head latent attention (MLA) and DeepSeek's routing. GGUF arch "deepseek2", llama.cpp's key
and tensor names (docs/gguf-layout.md).

What differs from the shared MoeModel mapping (transformers' modeling_deepseek_v2.py):
- attention: q from `q_proj` or, with `q_lora_rank`, `q_b_proj(q_a_layernorm(q_a_proj(x)))`;
  per head qk_nope_head_dim dims without rope, then qk_rope_head_dim with it. One latent per
  token: `kv_a_proj_with_mqa` gives kv_lora_rank dims (normed by kv_a_layernorm: the cached
  latent c_kv) and qk_rope_head_dim dims of a key shared by every head (the cached rope key);
  `kv_b_proj` [H (nope + v), rank] expands c_kv into each head's key (nope part) and value. It is
  written split as llama.cpp does for the absorbed decode: attn_k_b [H, rank, nope] (each head's
  key rows transposed) and attn_v_b [H, v, rank]. Written as llama.cpp: head_count_kv 1,
  key_length rank + rope, value_length rank (the cache's one latent "head"), key_length_mla /
  value_length_mla the per-head sizes;
- rope: transformers rotates the rope dims as interleaved pairs (2i, 2i + 1); the runtime
  rotates pairs (i, i + d/2). The rope rows of q (per head) and of the rope key are permuted
  here (even dims first, then odd), which turns one into the other and leaves q . k unchanged;
- YaRN with mscale: the softmax scale is (nope + rope)^-0.5 * (1 + yarn_log_multiplier
  ln(factor))^2 with yarn_log_multiplier = 0.1 mscale_all_dim (llama.cpp's key), cos/sin times
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) (rope.scaling.attn_factor);
- routing: softmax, top-k over all experts (topk_method greedy) or over the topk_group best of
  n_group groups (group_limited_greedy: a group's score is its best expert's), weights times
  routed_scaling_factor; n_shared_experts shared experts as one FFN of n_shared *
  moe_intermediate_size without a gate; the first first_k_dense_replace layers dense.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from gguf import GGUFWriter

from pyruntime.converter.base import MoeModel, register
from pyruntime.converter.hparams import HParams
from pyruntime.converter.sources import SourceTensors
from pyruntime.converter.tensors import OutTensor

TOPK_METHODS = ("greedy", "group_limited_greedy")


def rope_halves(d: int) -> np.ndarray:
    """The permutation of d rope dims that makes interleaved pairs (2i, 2i+1) into the pairs
    (i, i + d/2) of rotate_half: even dims first, then odd ones."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude scale (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@register("DeepseekV2ForCausalLM")
class DeepseekV2Model(MoeModel):
    gguf_arch = "deepseek2"
    n_expert_keys = ("n_routed_experts",)
    n_ff_exp_key = "moe_intermediate_size"
    rope_types = ("default", "yarn")

    def __init__(self, hp: HParams, src: SourceTensors, hf_arch: str) -> None:
        super().__init__(hp, src, hf_arch)
        if self.activation != "silu":
            raise hp._bad("hidden_act", "must be silu for DeepSeek-V2")
        if hp.bool("mlp_bias", False):
            raise hp._bad("mlp_bias", "true is not supported (DeepSeek-V2 has none)")
        self.q_rank = hp.int("q_lora_rank", default=0, minimum=1) if hp.has("q_lora_rank") else 0
        self.kv_rank = hp.int("kv_lora_rank")
        self.nope = hp.int("qk_nope_head_dim")
        self.rope_dim = hp.int("qk_rope_head_dim")
        self.v_dim = hp.int("v_head_dim")
        if self.rope_dim % 2:
            raise hp._bad("qk_rope_head_dim", f"must be even, got {self.rope_dim}")
        self.n_head_kv = 1  # one latent per token (llama.cpp: MLA as MQA)
        self.head_dim = self.kv_rank + self.rope_dim  # the cached latent and rope key
        self.value_dim = self.kv_rank
        self.n_shared = hp.int("n_shared_experts", default=0, minimum=0)
        self.n_dense = hp.int("first_k_dense_replace", default=0, minimum=0)
        self.dense_layers = [i for i in range(self.n_layer) if not self.is_moe_layer(i)]
        if hp.int("moe_layer_freq", default=1) != 1:
            raise hp._bad("moe_layer_freq", "must be 1 (every layer past the dense ones is MoE)")
        scoring = hp.config.get("scoring_func", "softmax")
        if scoring != "softmax":
            raise hp._bad("scoring_func", f"'{scoring}' is not supported (softmax only)")
        method = hp.config.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise hp._bad("topk_method", f"'{method}' is not supported ({', '.join(TOPK_METHODS)})")
        self.groups = (0, 0)
        if method == "group_limited_greedy":
            n_group, topk_group = hp.int("n_group"), hp.int("topk_group")
            if self.n_expert % n_group or topk_group > n_group:
                raise hp._bad(
                    "n_group",
                    f"is {n_group}: it must divide n_routed_experts {self.n_expert} and be >= "
                    f"topk_group {topk_group}",
                )
            if topk_group * (self.n_expert // n_group) < self.n_expert_used:
                raise hp._bad(
                    "topk_group",
                    f"is {topk_group}: its groups hold fewer experts than num_experts_per_tok "
                    f"{self.n_expert_used}",
                )
            self.groups = (n_group, topk_group)
        self.scale = hp.float("routed_scaling_factor", 1.0)
        if not self.scale > 0:
            raise hp._bad("routed_scaling_factor", f"must be > 0, got {self.scale}")
        self.yarn = self._yarn()

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.hp.int("first_k_dense_replace", default=0, minimum=0)

    def _yarn(self) -> dict[str, float] | None:
        """YaRN's fields (transformers' _compute_yarn_parameters with DeepSeek's mscale), or None
        for plain rope."""
        hp, params = self.hp, self.hp.rope_params()
        if (params.get("rope_type", params.get("type")) or "default") != "yarn":
            return None
        if params.get("truncate", True) is not True:
            raise hp._bad("rope_parameters.truncate", "must be true for DeepSeek-V2")
        orig = params.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise hp._bad(
                "rope_parameters.original_max_position_embeddings",
                f"must be an integer >= 1, got {orig!r}",
            )
        factor = hp.rope_number("factor")
        mscale = params.get("mscale") or 0.0
        mscale_all = params.get("mscale_all_dim") or 0.0
        if params.get("attention_factor") is not None:
            attn = hp.rope_number("attention_factor")
        elif mscale and mscale_all:
            attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attn = yarn_mscale(factor, 1.0)
        return {
            "factor": factor,
            "original_context_length": orig,
            "beta_fast": hp.rope_number("beta_fast", 32.0),
            "beta_slow": hp.rope_number("beta_slow", 1.0),
            "attn_factor": attn,
            "log_multiplier": 0.1 * float(mscale_all),
        }

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        super().set_gguf_parameters(w)
        a = self.gguf_arch
        if self.q_rank:
            w.add_uint32(f"{a}.attention.q_lora_rank", self.q_rank)
        w.add_uint32(f"{a}.attention.kv_lora_rank", self.kv_rank)
        w.add_uint32(f"{a}.attention.key_length_mla", self.nope + self.rope_dim)
        w.add_uint32(f"{a}.attention.value_length_mla", self.v_dim)
        w.add_uint32(f"{a}.leading_dense_block_count", len(self.dense_layers))
        w.add_uint32(f"{a}.expert_shared_count", self.n_shared)
        if self.n_shared:
            w.add_uint32(f"{a}.expert_shared_feed_forward_length", self.n_shared * self.n_ff_exp)
        w.add_float32(f"{a}.expert_weights_scale", self.scale)
        if self.groups[0]:
            w.add_uint32(f"{a}.expert_group_count", self.groups[0])
            w.add_uint32(f"{a}.expert_group_used_count", self.groups[1])
        if self.yarn is not None:
            y = self.yarn
            w.add_string(f"{a}.rope.scaling.type", "yarn")
            w.add_float32(f"{a}.rope.scaling.factor", y["factor"])
            w.add_uint32(f"{a}.rope.scaling.original_context_length", y["original_context_length"])
            w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", y["beta_fast"])
            w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", y["beta_slow"])
            w.add_float32(f"{a}.rope.scaling.attn_factor", y["attn_factor"])
            w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", y["log_multiplier"])

    # ---- tensors ----

    def attention_tensors(self, i: int) -> list[OutTensor]:
        hf, blk, layer, n = (
            f"model.layers.{i}.self_attn",
            f"blk.{i}",
            f"model.layers.{i}",
            self.n_embd,
        )
        H, qk = self.n_head, self.nope + self.rope_dim
        out = [self.copy(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (n,), "f32")]
        if self.q_rank:
            r = self.q_rank
            out += [
                self.copy(f"{blk}.attn_q_a.weight", f"{hf}.q_a_proj.weight", (r, n)),
                self.copy(f"{blk}.attn_q_a_norm.weight", f"{hf}.q_a_layernorm.weight", (r,), "f32"),
                self._q_rows(f"{blk}.attn_q_b.weight", f"{hf}.q_b_proj.weight", (H * qk, r)),
            ]
        else:
            out.append(self._q_rows(f"{blk}.attn_q.weight", f"{hf}.q_proj.weight", (H * qk, n)))
        kv_a = f"{hf}.kv_a_proj_with_mqa.weight"
        kv_rows = (self.kv_rank + self.rope_dim, n)
        self.src.claim(kv_a, kv_rows)
        keep = np.arange(self.kv_rank)
        order = np.concatenate([keep, self.kv_rank + rope_halves(self.rope_dim)])
        out.append(self._permuted(f"{blk}.attn_kv_a_mqa.weight", kv_a, kv_rows, order))
        kv_b = self.src.claim(
            f"{hf}.kv_b_proj.weight", (H * (self.nope + self.v_dim), self.kv_rank)
        )
        out += [
            self.copy(
                f"{blk}.attn_kv_a_norm.weight",
                f"{hf}.kv_a_layernorm.weight",
                (self.kv_rank,),
                "f32",
            ),
            OutTensor(
                f"{blk}.attn_k_b.weight",
                (H, self.kv_rank, self.nope),
                "weight",
                lambda: iter([self._kv_b(kv_b)[:, : self.nope].transpose(0, 2, 1)]),
            ),
            OutTensor(
                f"{blk}.attn_v_b.weight",
                (H, self.v_dim, self.kv_rank),
                "weight",
                lambda: iter([self._kv_b(kv_b)[:, self.nope :]]),
            ),
            self.copy(f"{blk}.attn_output.weight", f"{hf}.o_proj.weight", (n, H * self.v_dim)),
            self.copy(
                f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (n,), "f32"
            ),
        ]
        return out

    def _kv_b(self, name: str) -> np.ndarray:
        """kv_b_proj [H (nope + v), rank] as [H, nope + v, rank]."""
        return self.src.load(name).reshape(self.n_head, self.nope + self.v_dim, self.kv_rank)

    def _q_rows(self, out: str, hf: str, shape: tuple[int, int]) -> OutTensor:
        """A query projection [H (nope + rope), n_in] with each head's rope rows permuted."""
        self.src.claim(hf, shape)
        qk = self.nope + self.rope_dim
        head = np.concatenate([np.arange(self.nope), self.nope + rope_halves(self.rope_dim)])
        order = (np.arange(self.n_head)[:, None] * qk + head[None, :]).reshape(-1)
        return self._permuted(out, hf, shape, order)

    def _permuted(self, out: str, hf: str, shape: tuple[int, int], order: np.ndarray) -> OutTensor:
        def chunks() -> Iterator[np.ndarray]:
            yield self.src.load(hf).reshape(shape)[order]

        return OutTensor(out, shape, "weight", chunks)

    def ffn_tensors(self, i: int) -> list[OutTensor]:
        out = super().ffn_tensors(i)
        if self.is_moe_layer(i) and self.n_shared:
            out += self.dense_ffn(i, "mlp.shared_experts", "_shexp", self.n_shared * self.n_ff_exp)
        return out
