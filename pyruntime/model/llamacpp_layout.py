"""llama.cpp's GGUF layout of the supported families, beside ours (layout.py).

A GGUF that llama.cpp's converter (convert_hf_to_gguf.py) or llama-quantize wrote holds the routed
experts of a layer as three tensors, one per projection:

    blk.N.ffn_gate_exps.weight  [n_expert, n_ff_exp, n_embd]
    blk.N.ffn_up_exps.weight    [n_expert, n_ff_exp, n_embd]
    blk.N.ffn_down_exps.weight  [n_expert, n_embd, n_ff_exp]   (rows along n_ff_exp)

where our layout keeps each neuron's gate, up and down rows together in `ffn_gud_exps`. The rest
of the file means what ours means, with llama.cpp's reading of the metadata (src/llama-model.cpp
and src/models/<family>.cpp of llama.cpp):

- keys left out take llama.cpp's defaults: `rope.freq_base` 10000, `attention.head_count_kv` the
  head count, `attention.key_length` n_embd / n_head, `rope.dimension_count` the head size;
- the experts' size: olmoe, llama (Mixtral) and granitemoe size them by `feed_forward_length`;
  qwen2moe and qwen3moe by `expert_feed_forward_length`, else feed_forward_length / top-k, and
  qwen2moe's shared expert by `expert_shared_feed_forward_length`, else feed_forward_length;
- routing normalisation is fixed per family in llama.cpp's graph (FAMILIES below), not read from
  `expert_weights_norm`;
- rope: qwen2moe, qwen3moe and olmoe use llama.cpp's NEOX rope (pairs offset by half the head, as
  Hugging Face's rotate_half and our runtime); llama and granitemoe use its NORM rope (adjacent
  pairs), for which llama.cpp's converter permutes the rows of attn_q and attn_k inside each head
  (LlamaModel.permute). `unpermute_rows` undoes that;
- granitemoe's scales (`embedding_scale`, `residual_scale`, `attention.scale`) of 0 or absent
  mean "no scaling", and `logit_scale` is required.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import GGUFFile
from pyruntime.model.layout import QK_NORM, QKV_BIAS, WEIGHT, TensorSpec, check_specs

Q = GGMLQuantizationType
EXPERT_PROJECTIONS = ("gate", "up", "down")
_EXPS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
_SPLIT_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
# Small tensors a llama.cpp file may store in a float type other than F32 (the repack widens them)
SMALL = (Q.F32, Q.F16, Q.BF16)


@dataclass(frozen=True)
class Family:
    """What llama.cpp fixes for a family instead of reading it from the file."""

    hf_architecture: str  # the Hugging Face class the family comes from
    expert_weights_norm: bool  # build_moe_ffn's norm_w in src/models/<family>.cpp
    rope_norm: bool  # llama.cpp's NORM rope: attn_q / attn_k rows permuted per head
    experts_sized_by_expert_key: bool  # expert_feed_forward_length (else feed_forward_length)
    output_required: bool  # output.weight required (else tied to token_embd when absent)


FAMILIES: dict[str, Family] = {
    "olmoe": Family("OlmoeForCausalLM", False, False, False, True),
    "qwen2moe": Family("Qwen2MoeForCausalLM", False, False, True, True),
    "qwen3moe": Family("Qwen3MoeForCausalLM", True, False, True, False),
    "llama": Family("MixtralForCausalLM", True, True, False, False),
    "granitemoe": Family("GraniteMoeForCausalLM", True, True, False, False),
}

# llama.cpp's default of `{arch}.expert_weights_norm` per family: what its graph does
EXPERT_WEIGHTS_NORM = {arch: fam.expert_weights_norm for arch, fam in FAMILIES.items()}


def detect_layout(f: GGUFFile) -> str:
    """'pyruntime' (our layout, docs/gguf-layout.md), 'llama.cpp' (routed experts as
    ffn_{gate,up,down}_exps) or 'unknown' (no routed experts in either form)."""
    if "pyruntime.layout_version" in f.metadata:
        return "pyruntime"
    names = f.tensors.keys()
    if any(n.endswith(".ffn_gud_exps.weight") for n in names):
        return "pyruntime"
    if any(_EXPS.fullmatch(n) for n in names):
        return "llama.cpp"
    split = next((n for n in names if _SPLIT_EXPERT.fullmatch(n)), None)
    if split is not None:
        raise ModelFileError(
            f"{f.path}: tensor {split!r} holds one expert alone, llama.cpp's layout before 2024; "
            "convert the model again with a current llama.cpp or with convert_hf_to_gguf.py"
        )
    return "unknown"


def check_types(f: GGUFFile) -> None:
    """ModelFileError for the first tensor stored in a format pyruntime does not compute with,
    saying what to do."""
    for name, t in f.tensors.items():
        if t.qtype in WEIGHT:
            continue
        raise ModelFileError(
            f"{f.path}: tensor {name!r} is {t.qtype.name}, a format pyruntime does not read "
            f"(it reads {', '.join(q.name for q in WEIGHT)}); llama-quantize --allow-requantize "
            "IN OUT Q8_0 makes a file it reads"
        )


@dataclass(frozen=True)
class LlamaCppHParams:
    """The hyper-parameters of a llama.cpp file, with llama.cpp's defaults applied."""

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
    n_ff_shexp: int  # qwen2moe's shared expert, else 0

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaCppHParams:
        if f.arch not in FAMILIES:
            raise ModelFileError(
                f"{f.path}: architecture {f.arch!r} is not supported (supported: "
                f"{', '.join(FAMILIES)})"
            )
        key = _Reader(f)
        n_embd = key.int("embedding_length")
        n_head = key.int("attention.head_count")
        n_expert = key.int("expert_count")
        n_expert_used = key.int("expert_used_count")
        if n_expert_used > n_expert:
            raise key.bad("expert_used_count", f"is {n_expert_used}, more than expert_count")
        n_ff = key.int("feed_forward_length", None)
        if FAMILIES[f.arch].experts_sized_by_expert_key:
            by_ff = n_ff // n_expert_used if n_ff else None
            n_ff_exp = key.int("expert_feed_forward_length", by_ff)
        else:
            n_ff_exp = key.int("feed_forward_length")
        n_ff_shexp = key.int("expert_shared_feed_forward_length", n_ff) if f.arch in (
            "qwen2moe",
        ) else 0  # fmt: skip
        if f.arch == "granitemoe" and key.int("expert_shared_feed_forward_length", 0, 0):
            raise ModelFileError(
                f"{f.path}: a granitemoe model with shared experts (GraniteMoeShared) is not "
                "supported"
            )
        embd = f.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None and len(embd.shape) == 2 else None
        return cls(
            arch=f.arch,
            n_vocab=key.int("vocab_size", vocab or len(f.get("tokenizer.ggml.tokens", ()))),
            n_embd=n_embd,
            n_layer=key.int("block_count"),
            n_head=n_head,
            n_head_kv=key.int("attention.head_count_kv", n_head),
            head_dim=key.int("attention.key_length", n_embd // n_head or None),
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            n_ff_shexp=n_ff_shexp,
        )


class _Reader:
    """`{arch}.*` integer keys, each one integer in [minimum, 2^31) or absent (default)."""

    def __init__(self, f: GGUFFile) -> None:
        self.f = f

    def bad(self, suffix: str, why: str) -> ModelFileError:
        return ModelFileError(f"{self.f.path}: metadata key '{self.f.arch}.{suffix}' {why}")

    def int(self, suffix: str, default: object = ..., minimum: int = 1) -> int:
        value = self.f.arch_get(suffix, None)
        if value is None:
            if default is ... or default is None:
                raise self.bad(suffix, "is missing")
            return int(default)  # type: ignore[call-overload]
        if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):  # a per-layer array
            values = set(value.tolist() if hasattr(value, "tolist") else value)
            if len(values) != 1:
                raise self.bad(suffix, "differs between layers, which is not supported")
            (value,) = values
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(suffix, f"is {value!r}, expected one integer")
        if not minimum <= value < 1 << 31:
            raise self.bad(suffix, f"is {value}, outside [{minimum}, 2^31)")
        return value


def expected_tensors(f: GGUFFile, hp: LlamaCppHParams) -> dict[str, TensorSpec]:
    """Every tensor a llama.cpp file of `hp`'s family may hold, by name (shapes row-major).
    Small tensors may be any float type (the repack stores them as F32)."""
    n, v, fam = hp.n_embd, hp.n_vocab, hp.family
    q_rows, kv_rows = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    out_group = "" if fam.output_required else "output"
    specs = {
        "token_embd.weight": TensorSpec((v, n), WEIGHT),
        "output_norm.weight": TensorSpec((n,), SMALL),
        "output.weight": TensorSpec((v, n), WEIGHT, group=out_group),
    }
    qk_norm = QK_NORM.get(hp.arch)
    for i in range(hp.n_layer):
        p = f"blk.{i}"
        specs |= {
            f"{p}.attn_norm.weight": TensorSpec((n,), SMALL),
            f"{p}.attn_q.weight": TensorSpec((q_rows, n), WEIGHT),
            f"{p}.attn_k.weight": TensorSpec((kv_rows, n), WEIGHT),
            f"{p}.attn_v.weight": TensorSpec((kv_rows, n), WEIGHT),
            f"{p}.attn_output.weight": TensorSpec((n, q_rows), WEIGHT),
            f"{p}.ffn_norm.weight": TensorSpec((n,), SMALL),
            f"{p}.ffn_gate_inp.weight": TensorSpec((hp.n_expert, n), WEIGHT),
            f"{p}.ffn_gate_exps.weight": TensorSpec((hp.n_expert, hp.n_ff_exp, n), WEIGHT),
            f"{p}.ffn_up_exps.weight": TensorSpec((hp.n_expert, hp.n_ff_exp, n), WEIGHT),
            f"{p}.ffn_down_exps.weight": TensorSpec((hp.n_expert, n, hp.n_ff_exp), WEIGHT),
        }
        if hp.arch in QKV_BIAS:
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                specs[f"{p}.attn_{name}.bias"] = TensorSpec((rows,), SMALL, group=f"{p} biases")
        if qk_norm is not None:
            whole = qk_norm == "whole"
            q_norm, k_norm = (q_rows, kv_rows) if whole else (hp.head_dim, hp.head_dim)
            specs[f"{p}.attn_q_norm.weight"] = TensorSpec((q_norm,), SMALL)
            specs[f"{p}.attn_k_norm.weight"] = TensorSpec((k_norm,), SMALL)
        if hp.n_ff_shexp:
            ff = hp.n_ff_shexp
            specs |= {
                f"{p}.ffn_gate_shexp.weight": TensorSpec((ff, n), WEIGHT),
                f"{p}.ffn_up_shexp.weight": TensorSpec((ff, n), WEIGHT),
                f"{p}.ffn_down_shexp.weight": TensorSpec((n, ff), WEIGHT),
                # llama.cpp's converter writes the gate vector as [1, n_embd]
                f"{p}.ffn_gate_inp_shexp.weight": TensorSpec((n,), SMALL, alt_shape=(1, n)),
            }
    return specs


def check_tensors(f: GGUFFile, hp: LlamaCppHParams) -> None:
    """The file's tensors against llama.cpp's layout of its family: ModelFileError for the
    first one in a format pyruntime does not read, unknown, misshapen or missing."""
    check_types(f)
    check_specs(
        f,
        expected_tensors(f, hp),
        f"a llama.cpp {hp.arch} model with {hp.n_layer} layers that pyruntime runs",
    )


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's LlamaModel.permute of a q or k projection (n_rows =
    n_head * head_dim rows; n_head: the projection's heads, the kv heads for k): row r of the
    Hugging Face weight is row `order[r]` of the GGUF one. Within a head, llama.cpp stores the
    rows as (i, half) pairs, Hugging Face as (half, i)."""
    head = n_rows // n_head
    idx = np.arange(n_rows).reshape(n_head, head // 2, 2)  # GGUF rows: [head, i, half]
    return idx.transpose(0, 2, 1).reshape(-1)  # HF order: [head, half, i]
