"""Our GGUF layout's rules (docs/gguf-layout.md), checked where a model is built.

The reader (pyruntime.gguf) checks what every GGUF file must be; this module checks what a
pyruntime model file must hold beyond that: the layout version, the types of the keys the layout
adds, and every tensor: a name the layout knows for this family, the shape the hyper-parameters
imply, a type the runtime computes with; every tensor a layer needs, present. A file that passes
holds nothing a decoder could over-read: every norm and bias has its n_embd (or head) floats,
every matrix its rows, every expert block its neurons. Tensor data itself cannot be checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import GGUFFile
from pyruntime.gguf.header import FormatError
from pyruntime.gguf.keys import BOOL, INT32S, STR, U32, check_key_types
from pyruntime.gguf.keys import F32 as F32_KEY

LAYOUT_VERSION = 1

# The keys the layout adds to the standard ones (pyruntime.gguf.keys checks those).
LAYOUT_KEYS = {
    "pyruntime.layout_version": (U32,),
    "pyruntime.hf_architecture": (STR,),
    "pyruntime.expert_activation": (STR,),
    "pyruntime.stop_token_ids": (INT32S,),
    "pyruntime.swiglu_alpha": (F32_KEY,),
    "pyruntime.swiglu_limit": (F32_KEY,),
    "pyruntime.rope_yarn_truncate": (BOOL,),
}

Q = GGMLQuantizationType
# matrices: the formats the kernels read (Q5_0 / Q5_1: llama.cpp's fallback for K-quant rows
# that are not a multiple of 256)
WEIGHT = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
EXPERTS = (*WEIGHT, Q.MXFP4)  # the routed experts: also MXFP4 (the expert kernels read it)
F32 = (Q.F32,)  # norms, biases, routers, the shared-expert gate

# What differs by family: q/k RMSNorm over the whole projection or per head (required), q/k/v
# biases (all three or none; with the output projection's for gpt-oss), a shared expert in every
# MoE layer (required), attention sinks and router / expert biases (required: gpt-oss).
QK_NORM = {"olmoe": "whole", "qwen3moe": "head", "qwen35moe": "head"}
QKV_BIAS = ("qwen2moe", "gpt-oss")
O_BIAS = ("gpt-oss",)
SHARED_EXPERT = ("qwen2moe", "qwen35moe", "deepseek2", "llama4")
SHARED_GATE = ("qwen2moe", "qwen35moe")  # the shared expert's output *= sigmoid(x . gate)
# an output gate on full attention (attn_gate: out *= sigmoid(x W_gate^T)) (qwen35moe)
ATTN_GATE = ("qwen35moe",)
SINKS_AND_BIASED_EXPERTS = ("gpt-oss",)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # row-major, outermost first
    types: tuple[GGMLQuantizationType, ...]
    group: str = ""  # "": required; else optional, and all tensors of the group or none
    alt_shape: tuple[int, ...] | None = None  # another shape the same data may be stored as


def check_layout_keys(f: GGUFFile) -> None:
    """The layout version and the types of the layout's own keys."""
    try:
        check_key_types(f.signatures, LAYOUT_KEYS)
    except FormatError as exc:
        raise ModelFileError(f"{f.path}: {exc}") from None
    version = f.get("pyruntime.layout_version", None)
    if version is None and any(n.endswith("_exps.weight") for n in f.tensors):
        raise ModelFileError(
            f"{f.path}: the file is in llama.cpp's layout (experts as ffn_*_exps tensors); "
            "pyruntime.Model and the pyruntime commands repack it on first use, or run "
            "`pyruntime repack` on it"
        )
    if version is None:
        raise ModelFileError(
            f"{f.path}: metadata key 'pyruntime.layout_version' is missing and the file holds "
            "no routed experts (ffn_*_exps): not a Mixture-of-Experts model pyruntime runs"
        )
    if version != LAYOUT_VERSION:
        raise ModelFileError(
            f"{f.path}: GGUF layout version {version} is not supported (this pyruntime reads "
            f"version {LAYOUT_VERSION}); convert the model again with convert_hf_to_gguf.py"
        )


def expected_tensors(f: GGUFFile, cfg) -> dict[str, TensorSpec]:
    """Every tensor a model of `cfg` (a ModelConfig) may hold in this layout, by name. A layer
    is a MoE layer when the file holds its routed experts, else a dense FFN layer."""
    n, v = cfg.n_embd, cfg.n_vocab
    specs = {
        "token_embd.weight": TensorSpec((v, n), WEIGHT),
        "output_norm.weight": TensorSpec((n,), F32),
        "output.weight": TensorSpec((v, n), WEIGHT, group="output"),  # absent: tied to token_embd
    }
    qk_norm = QK_NORM.get(cfg.arch)
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        if cfg.is_recurrent(i):
            specs |= _deltanet_layer(cfg, p)
        elif cfg.is_mla:
            specs |= _mla_layer(cfg, p)
        else:
            specs |= _attention_layer(cfg, p, qk_norm)
        if f.has_tensor(f"{p}.ffn_gud_exps.weight"):
            specs |= _moe_layer(f, cfg, p)
        else:
            specs |= _dense_layer(f, cfg, p)
    return specs


def _deltanet_layer(cfg, p: str) -> dict[str, TensorSpec]:
    """A Gated DeltaNet layer (qwen35moe): the qkv, gate (z), beta and alpha projections, the
    conv over qkv's channels, per value head A and dt bias, the gated norm, the output."""
    n, C, K = cfg.n_embd, cfg.ssm_conv_channels, cfg.ssm_conv_kernel
    hv, v_dim = cfg.ssm_n_v_heads, cfg.ssm_n_v_heads * cfg.ssm_head_v_dim
    return {
        f"{p}.attn_norm.weight": TensorSpec((n,), F32),
        f"{p}.attn_qkv.weight": TensorSpec((C, n), WEIGHT),
        f"{p}.attn_gate.weight": TensorSpec((v_dim, n), WEIGHT),
        f"{p}.ssm_beta.weight": TensorSpec((hv, n), WEIGHT),
        f"{p}.ssm_alpha.weight": TensorSpec((hv, n), WEIGHT),
        f"{p}.ssm_conv1d.weight": TensorSpec((C, K), F32),
        f"{p}.ssm_dt.bias": TensorSpec((hv,), F32),
        f"{p}.ssm_a": TensorSpec((hv,), F32),
        f"{p}.ssm_norm.weight": TensorSpec((cfg.ssm_head_v_dim,), F32),
        f"{p}.ssm_out.weight": TensorSpec((n, v_dim), WEIGHT),
        f"{p}.ffn_norm.weight": TensorSpec((n,), F32),
    }


def _mla_layer(cfg, p: str) -> dict[str, TensorSpec]:
    """Multi-head latent attention (deepseek2; pyruntime.model.mla): the query (attn_q, or the
    LoRA attn_q_a -> attn_q_a_norm -> attn_q_b), the latent and rope key (attn_kv_a_mqa), the
    latent's norm, per head its key (attn_k_b [H, rank, nope]) and value (attn_v_b [H, v, rank])
    expansions, the output."""
    n, H, rank = cfg.n_embd, cfg.n_head, cfg.mla_kv_rank
    q_rows = H * (cfg.mla_nope_dim + cfg.rope_dim)
    specs = {
        f"{p}.attn_norm.weight": TensorSpec((n,), F32),
        f"{p}.attn_kv_a_mqa.weight": TensorSpec((rank + cfg.rope_dim, n), WEIGHT),
        f"{p}.attn_kv_a_norm.weight": TensorSpec((rank,), F32),
        f"{p}.attn_k_b.weight": TensorSpec((H, rank, cfg.mla_nope_dim), WEIGHT),
        f"{p}.attn_v_b.weight": TensorSpec((H, cfg.mla_v_dim, rank), WEIGHT),
        f"{p}.attn_output.weight": TensorSpec((n, H * cfg.mla_v_dim), WEIGHT),
        f"{p}.ffn_norm.weight": TensorSpec((n,), F32),
    }
    if cfg.mla_q_rank:
        r = cfg.mla_q_rank
        specs |= {
            f"{p}.attn_q_a.weight": TensorSpec((r, n), WEIGHT),
            f"{p}.attn_q_a_norm.weight": TensorSpec((r,), F32),
            f"{p}.attn_q_b.weight": TensorSpec((q_rows, r), WEIGHT),
        }
    else:
        specs[f"{p}.attn_q.weight"] = TensorSpec((q_rows, n), WEIGHT)
    return specs


def _attention_layer(cfg, p: str, qk_norm: str | None) -> dict[str, TensorSpec]:
    n = cfg.n_embd
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    specs = {
        f"{p}.attn_norm.weight": TensorSpec((n,), F32),
        f"{p}.attn_q.weight": TensorSpec((q_rows, n), WEIGHT),
        f"{p}.attn_k.weight": TensorSpec((kv_rows, n), WEIGHT),
        f"{p}.attn_v.weight": TensorSpec((kv_rows, n), WEIGHT),
        f"{p}.attn_output.weight": TensorSpec((n, q_rows), WEIGHT),
        f"{p}.ffn_norm.weight": TensorSpec((n,), F32),
    }
    if cfg.arch in QKV_BIAS:
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            specs[f"{p}.attn_{name}.bias"] = TensorSpec((rows,), F32, group=f"{p} biases")
        if cfg.arch in O_BIAS:
            specs[f"{p}.attn_output.bias"] = TensorSpec((n,), F32, group=f"{p} biases")
    if cfg.arch in SINKS_AND_BIASED_EXPERTS:
        specs[f"{p}.attn_sinks.weight"] = TensorSpec((cfg.n_head,), F32)
    if qk_norm is not None:
        whole = qk_norm == "whole"  # else per head
        q_norm, k_norm = (q_rows, kv_rows) if whole else (cfg.head_dim, cfg.head_dim)
        specs[f"{p}.attn_q_norm.weight"] = TensorSpec((q_norm,), F32)
        specs[f"{p}.attn_k_norm.weight"] = TensorSpec((k_norm,), F32)
    if cfg.arch in ATTN_GATE:
        specs[f"{p}.attn_gate.weight"] = TensorSpec((q_rows, n), WEIGHT)
    return specs


def _moe_layer(f: GGUFFile, cfg, p: str) -> dict[str, TensorSpec]:
    n = cfg.n_embd
    specs = {
        f"{p}.ffn_gate_inp.weight": TensorSpec((cfg.n_expert, n), F32),
        f"{p}.ffn_gud_exps.weight": TensorSpec((cfg.n_expert, cfg.n_ff_exp, 3, n), EXPERTS),
    }
    if cfg.arch in SINKS_AND_BIASED_EXPERTS:
        specs |= {
            f"{p}.ffn_gate_inp.bias": TensorSpec((cfg.n_expert,), F32),
            f"{p}.ffn_gu_exps.bias": TensorSpec((cfg.n_expert, cfg.n_ff_exp, 2), F32),
            f"{p}.ffn_down_exps.bias": TensorSpec((cfg.n_expert, n), F32),
        }
    if cfg.arch in SHARED_EXPERT:
        if not cfg.n_ff_shexp:
            raise ModelFileError(
                f"{f.path}: metadata key '{cfg.arch}.expert_shared_feed_forward_length' is "
                f"missing; a {cfg.arch} MoE layer has a shared expert"
            )
        ff = cfg.n_ff_shexp
        specs |= {
            f"{p}.ffn_gate_shexp.weight": TensorSpec((ff, n), WEIGHT),
            f"{p}.ffn_up_shexp.weight": TensorSpec((ff, n), WEIGHT),
            f"{p}.ffn_down_shexp.weight": TensorSpec((n, ff), WEIGHT),
        }
        if cfg.arch in SHARED_GATE:
            specs[f"{p}.ffn_gate_inp_shexp.weight"] = TensorSpec((n,), F32)
    return specs


def _dense_layer(f: GGUFFile, cfg, p: str) -> dict[str, TensorSpec]:
    key = f"{cfg.arch}.feed_forward_length"
    ff = f.get(key, None)
    if not isinstance(ff, int) or isinstance(ff, bool) or not 1 <= ff < 1 << 31:
        why = "is missing" if ff is None else f"is {ff!r}, expected one integer >= 1"
        raise ModelFileError(
            f"{f.path}: metadata key {key!r} {why}; layer {p} is a dense FFN layer (it has no "
            f"{p}.ffn_gud_exps.weight)"
        )
    n = cfg.n_embd
    return {
        f"{p}.ffn_gate.weight": TensorSpec((ff, n), WEIGHT),
        f"{p}.ffn_up.weight": TensorSpec((ff, n), WEIGHT),
        f"{p}.ffn_down.weight": TensorSpec((n, ff), WEIGHT),
    }


def check_tensors(f: GGUFFile, cfg) -> None:
    """ModelFileError for the first tensor that is unknown to the layout, of the wrong shape or
    type, or missing."""
    what = f"a {cfg.arch} model with {cfg.n_layer} layers in this layout (docs/gguf-layout.md)"
    _check_layer_count(f, cfg)
    check_specs(f, expected_tensors(f, cfg), what)


def _check_layer_count(f: GGUFFile, cfg) -> None:
    """A layer count past the file's blk.N tensors is refused before the layers' specs are built:
    a corrupt block_count (2^27 layers) would otherwise spend minutes listing tensors."""
    present = {name.split(".")[1] for name in f.tensors if name.startswith("blk.")}
    n_present = max((int(i) + 1 for i in present if i.isdecimal()), default=0)
    if cfg.n_layer > n_present:
        raise ModelFileError(
            f"{f.path}: metadata key '{cfg.arch}.block_count' is {cfg.n_layer}, but the file "
            f"holds tensors of {n_present} layers (no blk.{n_present}.* tensor)"
        )


def check_specs(f: GGUFFile, specs: dict[str, TensorSpec], what: str) -> None:
    """Every tensor of `f` against `specs` (a layout's tensors, by name; `what` names the layout
    and model in the error line): unknown, misshapen, of a wrong type, or missing."""
    for name, t in f.tensors.items():
        spec = specs.get(name)
        if spec is None:
            raise ModelFileError(f"{f.path}: tensor {name!r} is not part of {what}")
        if t.shape != spec.shape and t.shape != spec.alt_shape:
            raise ModelFileError(
                f"{f.path}: tensor {name!r} has shape {list(t.shape)}, but the model's "
                f"hyper-parameters make it {list(spec.shape)}"
            )
        if t.qtype not in spec.types:
            raise ModelFileError(
                f"{f.path}: tensor {name!r} is {t.qtype.name}; the layout stores it as "
                f"{' or '.join(q.name for q in spec.types)}"
            )
    groups: dict[str, list[str]] = {}
    for name, spec in specs.items():
        if spec.group:
            groups.setdefault(spec.group, []).append(name)
        elif name not in f.tensors:
            raise ModelFileError(f"{f.path}: tensor {name!r} is missing")
    for names in groups.values():
        present = [n for n in names if n in f.tensors]
        if present and len(present) < len(names):
            absent = next(n for n in names if n not in f.tensors)
            raise ModelFileError(
                f"{f.path}: tensor {absent!r} is missing (the file has {present[0]!r}, which "
                "comes with it)"
            )
