"""Llama-4 (`Llama4ForCausalLM`, and the text model of `Llama4ForConditionalGeneration`).

What differs from the shared MoeModel mapping (transformers' modeling_llama4.py):
- MoE layers are `moe_layers` (default every `interleave_moe_layer_step`-th); the others are dense
  SwiGLU FFNs of `intermediate_size_mlp` (`feed_forward.{gate,up,down}_proj`); the experts and
  the shared expert are `intermediate_size` wide;
- routing: top-k of the router logits, each chosen expert's weight sigmoid(logit) multiplies
  the expert's INPUT (not its output); a shared expert in every MoE layer, ungated;
- experts fused: `feed_forward.experts.gate_up_proj` [E, n_embd, 2 n_ff] (x @ W: columns
  [0, n_ff) gate, [n_ff, 2 n_ff) up) and `down_proj` [E, n_ff, n_embd] (row j is neuron j's);
- attention: rope on the layers `no_rope_layers` marks 1 (default: all but every
  `no_rope_layer_interval`-th), those attend within chunks of `attention_chunk_size` tokens and
  (use_qk_norm) L2-normalize q and k per head after rope; the other (NoPE) layers attend to
  every earlier token and (attn_temperature_tuning) scale q by
  1 + attn_scale log(1 + floor((pos + 1) / floor_scale));
- rope is the complex (interleaved) form, pairing dims (2i, 2i + 1): q_proj and k_proj rows are
  permuted per head to (0, 2, .., d - 2, 1, 3, .., d - 1) so that the runtime's rotate_half rope
  (pairing i, i + d/2) computes the same rotation. q . k, the per-head L2 norm and the NoPE
  layers are unchanged by the permutation (both q and k take it);
- rope scaling "llama3" (each frequency divided by `factor` past the original context's
  wavelengths, smoothed between low_freq_factor and high_freq_factor);
- a multimodal checkpoint stores the text model under `language_model.` (or transformers 5's
  `model.language_model.`) and its config under `text_config`; the vision tower and projector
  are not converted.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf import GGUFWriter

from pyruntime.converter.base import MoeModel, register
from pyruntime.converter.hparams import HParams
from pyruntime.converter.qwen35 import text_hparams
from pyruntime.converter.sources import SourceTensors
from pyruntime.converter.tensors import OutTensor

_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_SKIPPED = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
            "model.multi_modal_projector.")  # fmt: skip


@register("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
class Llama4Model(MoeModel):
    gguf_arch = "llama4"
    n_expert_keys = ("num_local_experts",)
    moe_prefixes = ("feed_forward",)
    router_names = ("router.weight",)
    rope_types = ("default", "llama3")
    # <|eot|> ends a turn; <|eom|> ends a message that awaits a tool's result (a stop token)
    end_of_turn_tokens = ("<|eot|>",)

    def __init__(self, hp: HParams, src: SourceTensors, hf_arch: str) -> None:
        for disk, ours in _TEXT_PREFIXES:
            src.rename_prefix(disk, ours)
        for prefix in _SKIPPED:
            src.skip_prefix(prefix)
        hp = text_hparams(hp)
        n_layer = hp.int("num_hidden_layers")
        step = hp.int("interleave_moe_layer_step", default=1)
        moe = hp.config.get("moe_layers")
        if moe is None:
            moe = list(range(step - 1, n_layer, step))  # Llama4TextConfig's default
        if not isinstance(moe, list) or not all(
            isinstance(i, int) and 0 <= i < n_layer for i in moe
        ):
            raise hp._bad("moe_layers", f"must list layer indices in 0..{n_layer - 1}")
        self.moe_set = set(moe)
        self.moe_step = step
        super().__init__(hp, src, hf_arch)
        hp = self.hp
        if self.activation != "silu":
            raise hp._bad("hidden_act", "must be silu for llama4")
        interval = hp.int("no_rope_layer_interval", default=4)
        rope_layers = hp.config.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(n_layer)
        ]  # Llama4TextConfig's default: 1 = the layer uses rope
        if (
            not isinstance(rope_layers, list)
            or len(rope_layers) != n_layer
            or set(rope_layers) - {0, 1}
        ):
            raise hp._bad("no_rope_layers", f"must list 0 or 1 for each of the {n_layer} layers")
        self.nope_layers = [not r for r in rope_layers]
        self.chunk = hp.int("attention_chunk_size", default=0, minimum=0)
        types = hp.config.get("layer_types")
        if types is not None:
            want = [
                "chunked_attention" if not nope and self.chunk else "full_attention"
                for nope in self.nope_layers
            ]
            if types != want:
                raise hp._bad(
                    "layer_types",
                    "must be chunked_attention on the rope layers (when attention_chunk_size is "
                    "set) and full_attention on the others (other patterns are not supported)",
                )
        self.qk_norm = hp.bool("use_qk_norm", True)
        tuning = hp.config.get("attn_temperature_tuning", True)
        if not isinstance(tuning, (bool, int)):  # Llama-4's first release wrote 4 (on)
            raise hp._bad("attn_temperature_tuning", f"must be true or false, got {tuning!r}")
        self.temperature = bool(tuning)
        self.floor_scale = hp.int("floor_scale", default=8192)
        self.attn_scale = hp.float("attn_scale", 0.1)
        self.n_ff_mlp = hp.int("intermediate_size_mlp", default=None if self.dense_layers else 0,
                               minimum=0)  # fmt: skip
        if hp.config.get("router_jitter_noise") not in (None, 0, 0.0):
            raise hp._bad("router_jitter_noise", "must be 0 (inference only)")
        self.llama3 = self._llama3() if self._rope_type() == "llama3" else None

    def _rope_type(self) -> str:
        params = self.hp.rope_params()
        return params.get("rope_type", params.get("type")) or "default"

    def _llama3(self) -> dict[str, float | int]:
        """The llama3 rope scaling fields (transformers' _compute_llama3_parameters)."""
        hp, params = self.hp, self.hp.rope_params()
        orig = params.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise hp._bad(
                "rope_parameters.original_max_position_embeddings",
                f"must be an integer >= 1, got {orig!r}",
            )
        low, high = hp.rope_number("low_freq_factor"), hp.rope_number("high_freq_factor")
        if high < low:  # equal in Llama-4's release: no blended band
            raise hp._bad("rope_parameters.high_freq_factor", f"must be >= low_freq_factor {low}")
        return {
            "factor": hp.rope_number("factor"),
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_context_length": orig,
        }

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_set

    def expert_weights_norm(self) -> bool:
        return False  # sigmoid weights, never renormalized

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        super().set_gguf_parameters(w)
        a = self.gguf_arch
        w.add_uint32(f"{a}.interleave_moe_layer_step", self.moe_step)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", self.n_ff_exp)
        w.add_array(f"{a}.attention.nope_layers", self.nope_layers)
        w.add_uint32(f"{a}.attention.chunk_size", self.chunk)
        w.add_bool(f"{a}.attention.qk_l2_norm", self.qk_norm)
        if self.temperature:
            w.add_uint32(f"{a}.attention.temperature_length", self.floor_scale)
            w.add_float32(f"{a}.attention.temperature_scale", self.attn_scale)
        if self.llama3 is not None:
            y = self.llama3
            w.add_string(f"{a}.rope.scaling.type", "llama3")
            w.add_float32(f"{a}.rope.scaling.factor", y["factor"])
            w.add_uint32(f"{a}.rope.scaling.original_context_length", y["original_context_length"])
            w.add_float32(f"{a}.rope.scaling.low_freq_factor", y["low_freq_factor"])
            w.add_float32(f"{a}.rope.scaling.high_freq_factor", y["high_freq_factor"])

    def dense_ffn_length(self) -> int:
        return self.n_ff_mlp or self.n_ff_exp  # no dense layer: llama.cpp wants the key anyway

    # ---- tensors ----

    def attention_tensors(self, i: int) -> list[OutTensor]:
        out = super().attention_tensors(i)
        d = self.head_dim
        order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
        for j, t in enumerate(out):
            if t.name.endswith(("attn_q.weight", "attn_k.weight")):
                out[j] = OutTensor(t.name, t.shape, t.kind, _permuted(t, order))
        return out

    def ffn_tensors(self, i: int) -> list[OutTensor]:
        if not self.is_moe_layer(i):
            return self.dense_ffn(i, "feed_forward", "", self.n_ff_mlp)
        return [
            self.router(i),
            self.routed_experts(i),
            *self.dense_ffn(i, "feed_forward.shared_expert", "_shexp", self.n_ff_exp),
        ]

    def routed_experts(self, i: int) -> OutTensor:
        """blk.{i}.ffn_gud_exps.weight [E, n_ff, 3, n_embd] from the fused [E, n, 2 n_ff] gate_up
        (gate columns, then up columns) and [E, n_ff, n] down."""
        E, ff, n = self.n_expert, self.n_ff_exp, self.n_embd
        base = f"model.layers.{i}.feed_forward.experts"
        gu = self.src.claim(f"{base}.gate_up_proj", (E, n, 2 * ff))
        dn = self.src.claim(f"{base}.down_proj", (E, ff, n))
        shape = (E, ff, 3, n)
        return OutTensor(
            f"blk.{i}.ffn_gud_exps.weight", shape, "experts", lambda: self._chunks(gu, dn)
        )

    def _chunks(self, gate_up: str, down: str) -> Iterator[np.ndarray]:
        ff = self.n_ff_exp
        for e in range(self.n_expert):
            gu = self.src.load_index(gate_up, e)  # [n_embd, 2 n_ff]
            yield np.stack([gu[:, :ff].T, gu[:, ff:].T, self.src.load_index(down, e)], axis=1)


def _permuted(t: OutTensor, order: np.ndarray):
    """The rows of a q or k projection [heads * d, n] reordered per head by `order` [d]."""
    d = len(order)

    def chunks() -> Iterator[np.ndarray]:
        w = np.concatenate(list(t.chunks())).reshape(-1, d, t.shape[-1])
        yield w[:, order].reshape(t.shape)

    return chunks
