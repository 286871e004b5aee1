"""GPT-OSS (`GptOssForCausalLM`): OpenAI's open-weight MoE (gpt-oss-20b, gpt-oss-120b).

What differs from the shared MoeModel mapping (transformers' modeling_gpt_oss.py):
- attention: biases on q/k/v/o, a learned per-head sink logit (`self_attn.sinks`), sliding-window
  attention on the layers `layer_types` marks, YaRN rope;
- the router has a bias; routing is softmax over the top-k logits (= renormalized top-k of the
  full softmax, so `expert_weights_norm` is true);
- experts: `gate_up_proj` [E, n_embd, 2 n_ff] with gate and up *interleaved* along the last axis
  (column 2j is neuron j's gate, 2j + 1 its up), `down_proj` [E, n_ff, n_embd] (row j is neuron
  j's down row already), biases `gate_up_proj_bias` [E, 2 n_ff] (interleaved too) and
  `down_proj_bias` [E, n_embd]; in OpenAI's release the two matrices are MXFP4
  (`*_blocks`/`*_scales`, decoded on read: pyruntime.converter.mxfp4_source);
- the experts' activation is the clamped SwiGLU `(clamp(up, ±limit) + 1) * g * sigmoid(alpha g)`
  with g = clamp(gate, max=limit) (`pyruntime.expert_activation` = swiglu_oai);
- the chat format is harmony: a turn ends with <|return|> (or <|call|>, a tool call, which
  generation_config.json lists), never with <|end|>, which ends each message of a turn.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf import GGUFWriter

from pyruntime.converter.base import MoeModel, register
from pyruntime.converter.mxfp4_source import decode_hf_mxfp4
from pyruntime.converter.tensors import OutTensor
from pyruntime.errors import ConversionError

SLIDING, FULL = "sliding_attention", "full_attention"


@register("GptOssForCausalLM")
class GptOssModel(MoeModel):
    gguf_arch = "gpt-oss"
    n_expert_keys = ("num_local_experts",)
    rope_types = ("default", "yarn")
    attention_bias_ok = True
    # harmony: <|end|> closes each message (the analysis channel too), <|return|> the turn
    end_of_turn_tokens = ("<|return|>",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hp = self.hp
        self.activation = "swiglu_oai"  # hidden_act is not what the experts apply
        types = hp.config.get("layer_types") or [
            SLIDING if i % 2 == 0 else FULL for i in range(self.n_layer)
        ]  # GptOssConfig's default: even layers sliding
        if (
            not isinstance(types, list)
            or len(types) != self.n_layer
            or set(types)
            - {
                SLIDING,
                FULL,
            }
        ):
            raise hp._bad(
                "layer_types",
                f"must list '{SLIDING}' or '{FULL}' for each of the {self.n_layer} layers",
            )
        self.sliding_layers = [t == SLIDING for t in types]
        self.sliding_window = hp.int("sliding_window", default=0, minimum=0)
        if any(self.sliding_layers) and self.sliding_window < 1:
            raise hp._bad("sliding_window", "must be >= 1 where layer_types has sliding layers")
        self.swiglu_alpha = hp.float("swiglu_alpha", 1.702)
        self.swiglu_limit = hp.float("swiglu_limit", 7.0)
        if self.swiglu_limit <= 0:
            raise hp._bad("swiglu_limit", f"must be > 0, got {self.swiglu_limit}")
        quant = hp.config.get("quantization_config")
        if quant is not None and (
            not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"
        ):
            raise hp._bad("quantization_config", "is not supported (only quant_method mxfp4)")
        self.yarn = self._yarn() if self._rope_type() == "yarn" else None

    def _rope_type(self) -> str:
        params = self.hp.rope_params()
        return params.get("rope_type", params.get("type")) or "default"

    def _yarn(self) -> dict[str, float | bool]:
        """The YaRN fields the runtime implements (transformers' _compute_yarn_parameters)."""
        hp, params = self.hp, self.hp.rope_params()
        for key in ("mscale", "mscale_all_dim"):
            if params.get(key):
                raise hp._bad(f"rope_parameters.{key}", "is not supported for gpt-oss (YaRN)")
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise hp._bad("rope_parameters.truncate", f"must be true or false, got {truncate!r}")
        orig = params.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise hp._bad(
                "rope_parameters.original_max_position_embeddings",
                f"must be an integer >= 1, got {orig!r}",
            )
        out: dict[str, float | bool] = {
            "factor": hp.rope_number("factor"),
            "original_context_length": orig,
            "beta_fast": hp.rope_number("beta_fast", 32.0),
            "beta_slow": hp.rope_number("beta_slow", 1.0),
            "truncate": truncate,
        }
        if params.get("attention_factor") is not None:
            out["attn_factor"] = hp.rope_number("attention_factor")
        return out

    def has_qkv_bias(self) -> bool:
        return self.hp.bool("attention_bias", True)

    def expert_weights_norm(self) -> bool:
        return True  # softmax over the top-k logits == renormalized top-k of the full softmax

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        super().set_gguf_parameters(w)
        a = self.gguf_arch
        if any(self.sliding_layers):
            w.add_uint32(f"{a}.attention.sliding_window", self.sliding_window)
            w.add_array(f"{a}.attention.sliding_window_pattern", self.sliding_layers)
        if self.yarn is not None:
            y = self.yarn
            w.add_string(f"{a}.rope.scaling.type", "yarn")
            w.add_float32(f"{a}.rope.scaling.factor", y["factor"])
            w.add_uint32(f"{a}.rope.scaling.original_context_length", y["original_context_length"])
            w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", y["beta_fast"])
            w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", y["beta_slow"])
            w.add_bool("pyruntime.rope_yarn_truncate", y["truncate"])
            if "attn_factor" in y:
                w.add_float32(f"{a}.rope.scaling.attn_factor", y["attn_factor"])
        w.add_float32("pyruntime.swiglu_alpha", self.swiglu_alpha)
        w.add_float32("pyruntime.swiglu_limit", self.swiglu_limit)

    # ---- tensors ----

    def attention_tensors(self, i: int) -> list[OutTensor]:
        out = super().attention_tensors(i)
        hf, blk = f"model.layers.{i}.self_attn", f"blk.{i}"
        extra = [self.copy(f"{blk}.attn_sinks.weight", f"{hf}.sinks", (self.n_head,), "f32")]
        if self.has_qkv_bias():
            extra.insert(
                0, self.copy(f"{blk}.attn_output.bias", f"{hf}.o_proj.bias", (self.n_embd,), "f32")
            )
        return out[:-1] + extra + out[-1:]  # before ffn_norm, as the other attention tensors

    def ffn_tensors(self, i: int) -> list[OutTensor]:
        hf, blk = f"model.layers.{i}.mlp", f"blk.{i}"
        E, ff, n = self.n_expert, self.n_ff_exp, self.n_embd
        return [
            self.copy(f"{blk}.ffn_gate_inp.weight", f"{hf}.router.weight", (E, n), "f32"),
            self.copy(f"{blk}.ffn_gate_inp.bias", f"{hf}.router.bias", (E,), "f32"),
            self.routed_experts(i),
            # [E, 2 n_ff] interleaved (gate j, up j) is [E, n_ff, 2] as it is
            self._reshaped(
                f"{blk}.ffn_gu_exps.bias",
                f"{hf}.experts.gate_up_proj_bias",
                (E, 2 * ff),
                (E, ff, 2),
            ),
            self.copy(f"{blk}.ffn_down_exps.bias", f"{hf}.experts.down_proj_bias", (E, n), "f32"),
        ]

    def _reshaped(
        self, out: str, hf: str, shape: tuple[int, ...], out_shape: tuple[int, ...]
    ) -> OutTensor:
        self.src.claim(hf, shape)
        return self._from_source(out, hf, out_shape, "f32")

    def routed_experts(self, i: int) -> OutTensor:
        """blk.{i}.ffn_gud_exps.weight [E, n_ff, 3, n_embd] from float or MXFP4 storage."""
        E, ff, n = self.n_expert, self.n_ff_exp, self.n_embd
        base = f"model.layers.{i}.mlp.experts"
        out_name, shape = f"blk.{i}.ffn_gud_exps.weight", (E, ff, 3, n)
        if f"{base}.gate_up_proj_blocks" in self.src:
            gu = self._claim_mxfp4(f"{base}.gate_up_proj", (E, 2 * ff), n)
            dn = self._claim_mxfp4(f"{base}.down_proj", (E, n), ff)
            return OutTensor(out_name, shape, "experts", lambda: self._mxfp4_chunks(gu, dn))
        gu = self.src.claim(f"{base}.gate_up_proj", (E, n, 2 * ff))
        dn = self.src.claim(f"{base}.down_proj", (E, ff, n))
        return OutTensor(out_name, shape, "experts", lambda: self._float_chunks(gu, dn))

    def _claim_mxfp4(self, name: str, rows: tuple[int, int], row_len: int) -> str:
        if row_len % 32:
            raise ConversionError(
                f"tensor {name}_blocks: rows of {row_len} elements are not whole MXFP4 blocks of 32"
            )
        self.src.claim(f"{name}_blocks", (*rows, row_len // 32, 16))
        self.src.claim(f"{name}_scales", (*rows, row_len // 32))
        return name

    def _float_chunks(self, gate_up: str, down: str) -> Iterator[np.ndarray]:
        for e in range(self.n_expert):
            gu = self.src.load_index(gate_up, e)  # [n_embd, 2 n_ff]: x @ gu, columns interleaved
            dn = self.src.load_index(down, e)  # [n_ff, n_embd]: row j is neuron j's down row
            yield np.stack([gu[:, 0::2].T, gu[:, 1::2].T, dn], axis=1)

    def _mxfp4_chunks(self, gate_up: str, down: str) -> Iterator[np.ndarray]:
        for e in range(self.n_expert):
            gu = self._decode(gate_up, e)  # [2 n_ff, n_embd]: row 2j gate j, row 2j + 1 up j
            dn = self._decode(down, e)  # [n_embd, n_ff]: column j is neuron j's down row
            yield np.stack([gu[0::2], gu[1::2], dn.T], axis=1)

    def _decode(self, name: str, e: int) -> np.ndarray:
        blocks = self.src.load_bytes_index(f"{name}_blocks", e)
        scales = self.src.load_bytes_index(f"{name}_scales", e)
        return decode_hf_mxfp4(blocks, scales, name, (e,))
