"""The architecture registry and the shared MoE decoder mapping.

Adding an architecture is one class (llama.cpp style)::

    @register("Qwen3MoeForCausalLM")
    class Qwen3MoeModel(MoeModel):
        gguf_arch = "qwen3moe"
        def set_gguf_parameters(self, w): ...      # extra metadata keys
        def layer_tensors(self, i): ...            # HF -> GGUF tensor mapping of block i

`MoeModel` already maps everything the five supported families share (embeddings, attention,
norms, router, routed experts in both on-disk storages, dense FFN layers, lm_head); a subclass
sets class attributes for its config field names and tensor names and overrides the hooks
where its family differs. Names and shapes follow docs/gguf-layout.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np
from gguf import GGUFWriter

from pyruntime.converter.hparams import HParams
from pyruntime.converter.sources import SourceTensors
from pyruntime.converter.tensors import Kind, OutTensor
from pyruntime.converter.vocab import END_OF_TURN_TOKENS
from pyruntime.errors import ConversionError

_REGISTRY: dict[str, type[MoeModel]] = {}


def register(*hf_architectures: str) -> Callable[[type[MoeModel]], type[MoeModel]]:
    """Class decorator: convert checkpoints whose config.json `architectures` names this class."""

    def wrap(cls: type[MoeModel]) -> type[MoeModel]:
        for name in hf_architectures:
            _REGISTRY[name] = cls
        return cls

    return wrap


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class_for(hp: HParams) -> tuple[str, type[MoeModel]]:
    """The registered class for config.json's `architectures`, or a ConversionError listing ours."""
    archs = hp.config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConversionError(
            f"{hp.path}: field 'architectures' is missing or empty; it must name the HF model "
            f"class, one of {', '.join(supported_architectures())}"
        )
    for name in archs:
        if name in _REGISTRY:
            return name, _REGISTRY[name]
    raise ConversionError(
        f"{hp.path}: unsupported architecture {', '.join(map(str, archs))}; "
        f"supported: {', '.join(supported_architectures())}"
    )


class MoeModel:
    """A decoder-only MoE transformer with RMSNorm, rotary attention and SwiGLU-style experts."""

    gguf_arch: ClassVar[str]
    # config.json field names, first present wins (transformers renames some across versions)
    n_expert_keys: ClassVar[tuple[str, ...]] = ("num_experts", "num_local_experts")
    n_ff_exp_key: ClassVar[str] = "intermediate_size"
    # Where the MoE block lives under `model.layers.{i}.`, first match wins.
    moe_prefixes: ClassVar[tuple[str, ...]] = ("mlp",)
    router_names: ClassVar[tuple[str, ...]] = ("gate.weight",)
    # Per-expert storage (gate, up, down), `{e}` is the expert index.
    per_expert_names: ClassVar[tuple[tuple[str, str, str], ...]] = (
        (
            "experts.{e}.gate_proj.weight",
            "experts.{e}.up_proj.weight",
            "experts.{e}.down_proj.weight",
        ),
    )
    # Fused storage (gate_up [E, 2*n_ff, n_embd] = gate rows then up rows; down [E, n_embd, n_ff]),
    # as transformers 5 holds experts in memory (OlmoeExperts & co: `.chunk(2, dim=-1)`).
    fused_names: ClassVar[tuple[tuple[str, str], ...]] = (
        ("experts.gate_up_proj", "experts.down_proj"),
    )
    rope_types: ClassVar[tuple[str, ...]] = ("default",)  # rope_parameters.rope_type accepted
    attention_bias_ok: ClassVar[bool] = False  # config `attention_bias: true` accepted
    partial_rotary_ok: ClassVar[bool] = False  # a partial_rotary_factor < 1 accepted
    # tokens that end an assistant turn (tokenizer.ggml.eot_token_id), first present wins
    end_of_turn_tokens: ClassVar[tuple[str, ...]] = END_OF_TURN_TOKENS

    def __init__(self, hp: HParams, src: SourceTensors, hf_arch: str) -> None:
        self.hp, self.src, self.hf_arch = hp, src, hf_arch
        self.n_vocab = hp.int("vocab_size")
        self.n_embd = hp.int("hidden_size")
        self.n_layer = hp.int("num_hidden_layers")
        self.n_head = hp.int("num_attention_heads")
        self.n_head_kv = hp.int("num_key_value_heads", default=self.n_head)
        self.head_dim = hp.head_dim()
        self.rope_dim = self.head_dim  # dims of a head that rope rotates
        self.value_dim = self.head_dim  # attention.value_length
        self.n_expert = hp.int(
            next((k for k in self.n_expert_keys if hp.has(k)), self.n_expert_keys[0])
        )
        self.n_expert_used = hp.int("num_experts_per_tok")
        self.n_ff_exp = hp.int(self.n_ff_exp_key)
        self.rope_theta = hp.rope_theta(self.rope_types, self.partial_rotary_ok)
        self.activation = hp.activation()
        if self.n_head % self.n_head_kv:
            raise hp._bad("num_key_value_heads", f"must divide num_attention_heads {self.n_head}")
        if self.n_expert_used > self.n_expert:
            raise hp._bad("num_experts_per_tok", f"exceeds the expert count {self.n_expert}")
        if hp.bool("attention_bias", False) and not self.attention_bias_ok:
            raise hp._bad("attention_bias", f"true is not supported for {hf_arch}")
        self.dense_layers = [i for i in range(self.n_layer) if not self.is_moe_layer(i)]

    # ---- hooks a family overrides ----

    def has_qkv_bias(self) -> bool:
        """Whether q/k/v projections carry biases (written as attn_{q,k,v}.bias)."""
        return False

    def is_moe_layer(self, i: int) -> bool:
        return True

    def expert_weights_norm(self) -> bool:
        return self.hp.bool("norm_topk_prob", False)

    def qk_norm_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        return None

    def dense_ffn_length(self) -> int:
        """The dense FFN layers' width ({arch}.feed_forward_length)."""
        return self.hp.int("intermediate_size")

    def set_gguf_parameters(self, w: GGUFWriter) -> None:
        """Architecture metadata keys ({arch}.*) and pyruntime.expert_activation."""
        a = self.gguf_arch
        w.add_uint32(f"{a}.vocab_size", self.n_vocab)
        w.add_uint32(f"{a}.context_length", self.hp.int("max_position_embeddings"))
        w.add_uint32(f"{a}.embedding_length", self.n_embd)
        w.add_uint32(f"{a}.block_count", self.n_layer)
        if self.dense_layers or self.hp.has("intermediate_size"):  # as llama.cpp writes it: the
            # experts' size (olmoe, llama, granitemoe) or the dense layers' (qwen)
            w.add_uint32(f"{a}.feed_forward_length", self.dense_ffn_length())
        w.add_uint32(f"{a}.expert_feed_forward_length", self.n_ff_exp)
        w.add_uint32(f"{a}.expert_count", self.n_expert)
        w.add_uint32(f"{a}.expert_used_count", self.n_expert_used)
        w.add_bool(f"{a}.expert_weights_norm", self.expert_weights_norm())
        w.add_uint32(f"{a}.attention.head_count", self.n_head)
        w.add_uint32(f"{a}.attention.head_count_kv", self.n_head_kv)
        w.add_uint32(f"{a}.attention.key_length", self.head_dim)
        w.add_uint32(f"{a}.attention.value_length", self.value_dim)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", self.hp.float("rms_norm_eps"))
        w.add_float32(f"{a}.rope.freq_base", self.rope_theta)
        w.add_uint32(f"{a}.rope.dimension_count", self.rope_dim)
        w.add_string("pyruntime.expert_activation", self.activation)

    # ---- the tensor mapping ----

    def tensor_plan(self) -> list[OutTensor]:
        """Every output tensor in file order; claims the HF names it reads (see SourceTensors)."""
        n, v = self.n_embd, self.n_vocab
        plan = [self.copy("token_embd.weight", "model.embed_tokens.weight", (v, n), "embd")]
        for i in range(self.n_layer):
            plan += self.layer_tensors(i)
        plan.append(self.copy("output_norm.weight", "model.norm.weight", (n,), "f32"))
        tied = self.hp.config.get("tie_word_embeddings")
        if tied is True:
            self.src.claim_if_present("lm_head.weight")  # some exporters save the tied copy
        elif tied is False or "lm_head.weight" in self.src:
            plan.append(self.copy("output.weight", "lm_head.weight", (v, n), "embd"))
        return plan

    def layer_tensors(self, i: int) -> list[OutTensor]:
        return self.attention_tensors(i) + self.ffn_tensors(i)

    def attention_tensors(self, i: int) -> list[OutTensor]:
        hf, blk = f"model.layers.{i}", f"blk.{i}"
        n, q_rows, kv_rows = (
            self.n_embd,
            self.n_head * self.head_dim,
            self.n_head_kv * self.head_dim,
        )
        out = [
            self.copy(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (n,), "f32"),
            self.copy(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (q_rows, n)),
            self.copy(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv_rows, n)),
            self.copy(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_rows, n)),
        ]
        if self.has_qkv_bias():
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                out.append(
                    self.copy(
                        f"{blk}.attn_{proj}.bias",
                        f"{hf}.self_attn.{proj}_proj.bias",
                        (rows,),
                        "f32",
                    )
                )
        out.append(
            self.copy(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (n, q_rows))
        )
        norms = self.qk_norm_shapes()
        if norms is not None:
            out.append(
                self.copy(
                    f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", norms[0], "f32"
                )
            )
            out.append(
                self.copy(
                    f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", norms[1], "f32"
                )
            )
        out.append(
            self.copy(
                f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (n,), "f32"
            )
        )
        return out

    def ffn_tensors(self, i: int) -> list[OutTensor]:
        if not self.is_moe_layer(i):
            return self.dense_ffn(i, "mlp", "", self.hp.int("intermediate_size"))
        return [self.router(i), self.routed_experts(i)]

    def dense_ffn(self, i: int, hf_module: str, suffix: str, n_ff: int) -> list[OutTensor]:
        """SwiGLU FFN `model.layers.{i}.{hf_module}.{gate,up,down}_proj` ->
        `blk.{i}.ffn_{gate,up,down}{suffix}.weight`."""
        hf, blk, n = f"model.layers.{i}.{hf_module}", f"blk.{i}", self.n_embd
        return [
            self.copy(f"{blk}.ffn_gate{suffix}.weight", f"{hf}.gate_proj.weight", (n_ff, n)),
            self.copy(f"{blk}.ffn_up{suffix}.weight", f"{hf}.up_proj.weight", (n_ff, n)),
            self.copy(f"{blk}.ffn_down{suffix}.weight", f"{hf}.down_proj.weight", (n, n_ff)),
        ]

    def _moe_candidates(self, i: int, names: tuple[str, ...]) -> list[str]:
        return [f"model.layers.{i}.{p}.{name}" for p in self.moe_prefixes for name in names]

    def router(self, i: int) -> OutTensor:
        name = self.src.claim_first(
            self._moe_candidates(i, self.router_names), (self.n_expert, self.n_embd)
        )
        return self._from_source(
            f"blk.{i}.ffn_gate_inp.weight", name, (self.n_expert, self.n_embd), "f32"
        )

    def routed_experts(self, i: int) -> OutTensor:
        """blk.{i}.ffn_gud_exps.weight [E, n_ff, 3, n_embd]: per neuron j, rows gate[j], up[j],
        down[:, j]; read from per-expert or fused storage, whichever the checkpoint has."""
        E, ff, n = self.n_expert, self.n_ff_exp, self.n_embd
        out_name, shape = f"blk.{i}.ffn_gud_exps.weight", (E, ff, 3, n)
        for prefix in self.moe_prefixes:
            base = f"model.layers.{i}.{prefix}"
            for gate_up, down in self.fused_names:
                if f"{base}.{gate_up}" in self.src:
                    gu = self.src.claim(f"{base}.{gate_up}", (E, 2 * ff, n))
                    dn = self.src.claim(f"{base}.{down}", (E, n, ff))
                    return OutTensor(
                        out_name, shape, "experts", lambda gu=gu, dn=dn: self._fused_chunks(gu, dn)
                    )
        # Per-expert storage; if absent, the default names are claimed and reported missing.
        triples = [
            (f"model.layers.{i}.{p}.", t) for p in self.moe_prefixes for t in self.per_expert_names
        ]
        base, triple = next(
            ((b, t) for b, t in triples if b + t[0].format(e=0) in self.src), triples[0]
        )
        names = [
            (
                self.src.claim(base + triple[0].format(e=e), (ff, n)),
                self.src.claim(base + triple[1].format(e=e), (ff, n)),
                self.src.claim(base + triple[2].format(e=e), (n, ff)),
            )
            for e in range(E)
        ]
        return OutTensor(out_name, shape, "experts", lambda: self._per_expert_chunks(names))

    def _fused_chunks(self, gate_up: str, down: str) -> Iterator[np.ndarray]:
        ff = self.n_ff_exp
        for e in range(self.n_expert):
            gu = self.src.load_index(gate_up, e)  # [2*ff, n]: gate rows, then up rows
            yield np.stack([gu[:ff], gu[ff:], self.src.load_index(down, e).T], axis=1)

    def _per_expert_chunks(self, names: list[tuple[str, str, str]]) -> Iterator[np.ndarray]:
        for gate, up, down in names:  # one expert: [ff, 3, n]
            load = self.src.load
            yield np.stack([load(gate), load(up), load(down).T], axis=1)

    # ---- helpers ----

    def copy(self, out: str, hf: str, shape: tuple[int, ...], kind: Kind = "weight") -> OutTensor:
        """A tensor copied as is (claimed with a shape check)."""
        self.src.claim(hf, shape)
        return self._from_source(out, hf, shape, kind)

    def _from_source(self, out: str, hf: str, shape: tuple[int, ...], kind: Kind) -> OutTensor:
        def chunks() -> Iterator[np.ndarray]:
            yield self.src.load(hf).reshape(shape)

        return OutTensor(out, shape, kind, chunks)
