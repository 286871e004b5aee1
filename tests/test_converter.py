"""HF -> GGUF converter: layout contract (docs/gguf-layout.md), errors, CLI, Hub cache.

The reference for every tensor is the transformers model itself (loaded with from_pretrained,
i.e. through transformers' own checkpoint conversion), mapped to GGUF names here independently
of the converter's code. f32/f16 must match exactly; bf16/q8_0/q4_0 must be byte-identical to
`gguf.quants.quantize` of the reference rows (and within the format's rounding bound).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from hf_fixtures import ARCHS, make_tiny_hf_model
from safetensors.torch import load_file, save_file

from pyruntime.converter import convert, supported_architectures
from pyruntime.errors import ConversionError

Q = GGMLQuantizationType
REPO = Path(__file__).resolve().parents[1]
GGUF_ARCH = {
    "olmoe": "olmoe",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "qwen35moe": "qwen35moe",
    "mixtral": "llama",
    "granitemoe": "granitemoe",
    "gptoss": "gpt-oss",
    "deepseek2": "deepseek2",
    "llama4": "llama4",
}
W_TYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


@cache
def _model(root: Path, arch: str, fused: bool) -> tuple[Path, dict[str, np.ndarray]]:
    """(checkpoint dir, reference GGUF tensors) for one arch and expert storage, built once."""
    path = make_tiny_hf_model(arch, root / f"{arch}-{'fused' if fused else 'split'}", fused)
    return path, _reference_tensors(arch, path)


def _reference_tensors(arch: str, path: Path) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array from transformers' in-memory weights (docs/gguf-layout.md)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    moe = "block_sparse_moe" if arch == "granitemoe" else "mlp"
    if arch == "qwen35moe":
        out["output_norm.weight"] = out["output_norm.weight"] + 1
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if arch == "qwen35moe":
            out |= _qwen35_attention(sd, cfg, p, b)
            out |= _qwen35_ffn(sd, p, b)
            continue
        if arch == "deepseek2":
            out |= _deepseek2_attention(sd, cfg, p, b)
        out[f"{b}.attn_norm.weight"] = sd[f"{p}.input_layernorm.weight"]
        out[f"{b}.ffn_norm.weight"] = sd[f"{p}.post_attention_layernorm.weight"]
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            if arch == "deepseek2":
                break
            out[f"{b}.{name}.weight"] = sd[f"{p}.self_attn.{proj}_proj.weight"]
            if f"{p}.self_attn.{proj}_proj.bias" in sd:
                out[f"{b}.{name}.bias"] = sd[f"{p}.self_attn.{proj}_proj.bias"]
        for norm in ("q_norm", "k_norm"):
            if f"{p}.self_attn.{norm}.weight" in sd:
                out[f"{b}.attn_{norm}.weight"] = sd[f"{p}.self_attn.{norm}.weight"]
        if arch == "gptoss":
            out |= _gptoss_layer(sd, p, b)
            continue
        if arch == "llama4":
            out |= _llama4_layer(sd, cfg, p, b)
            continue
        gu = sd.get(f"{p}.{moe}.experts.gate_up_proj")  # [E, 2*ff, n], gate rows then up rows
        if gu is None:  # dense layer
            for proj in ("gate", "up", "down"):
                out[f"{b}.ffn_{proj}.weight"] = sd[f"{p}.mlp.{proj}_proj.weight"]
            continue
        down = sd[f"{p}.{moe}.experts.down_proj"]  # [E, n, ff]
        ff = down.shape[2]
        gud = np.empty((gu.shape[0], ff, 3, gu.shape[2]), np.float32)
        for e in range(gu.shape[0]):
            for j in range(ff):
                gud[e, j] = gu[e, j], gu[e, ff + j], down[e, :, j]
        out[f"{b}.ffn_gud_exps.weight"] = gud
        router = sd.get(f"{p}.{moe}.gate.weight", sd.get(f"{p}.{moe}.router.weight"))
        out[f"{b}.ffn_gate_inp.weight"] = router
        if f"{p}.mlp.shared_expert_gate.weight" in sd:
            out[f"{b}.ffn_gate_inp_shexp.weight"] = sd[f"{p}.mlp.shared_expert_gate.weight"][0]
            for proj in ("gate", "up", "down"):
                out[f"{b}.ffn_{proj}_shexp.weight"] = sd[
                    f"{p}.mlp.shared_expert.{proj}_proj.weight"
                ]
        if f"{p}.mlp.shared_experts.gate_proj.weight" in sd:  # deepseek2: no gate
            for proj in ("gate", "up", "down"):
                out[f"{b}.ffn_{proj}_shexp.weight"] = sd[
                    f"{p}.mlp.shared_experts.{proj}_proj.weight"
                ]
    return out


def _qwen35_attention(sd: dict[str, np.ndarray], cfg, p: str, b: str) -> dict[str, np.ndarray]:
    """Qwen3.5-MoE: zero-centred norms written as 1 + w (not the DeltaNet's gated norm); a
    DeltaNet layer's projections, conv [C, 1, K] as [C, K], A = -exp(A_log); a full-attention
    layer's q_proj split per head into the query and its output gate."""
    out = {
        f"{b}.attn_norm.weight": sd[f"{p}.input_layernorm.weight"] + 1,
        f"{b}.ffn_norm.weight": sd[f"{p}.post_attention_layernorm.weight"] + 1,
    }
    la = f"{p}.linear_attn"
    if f"{la}.A_log" in sd:
        return out | {
            f"{b}.attn_qkv.weight": sd[f"{la}.in_proj_qkv.weight"],
            f"{b}.attn_gate.weight": sd[f"{la}.in_proj_z.weight"],
            f"{b}.ssm_beta.weight": sd[f"{la}.in_proj_b.weight"],
            f"{b}.ssm_alpha.weight": sd[f"{la}.in_proj_a.weight"],
            f"{b}.ssm_conv1d.weight": sd[f"{la}.conv1d.weight"][:, 0, :],
            f"{b}.ssm_dt.bias": sd[f"{la}.dt_bias"],
            f"{b}.ssm_a": -np.exp(sd[f"{la}.A_log"]),
            f"{b}.ssm_norm.weight": sd[f"{la}.norm.weight"],
            f"{b}.ssm_out.weight": sd[f"{la}.out_proj.weight"],
        }
    sa, hd = f"{p}.self_attn", cfg.head_dim
    q = sd[f"{sa}.q_proj.weight"].reshape(cfg.num_attention_heads, 2, hd, -1)
    return out | {
        f"{b}.attn_q.weight": q[:, 0].reshape(-1, q.shape[-1]),
        f"{b}.attn_gate.weight": q[:, 1].reshape(-1, q.shape[-1]),
        f"{b}.attn_k.weight": sd[f"{sa}.k_proj.weight"],
        f"{b}.attn_v.weight": sd[f"{sa}.v_proj.weight"],
        f"{b}.attn_output.weight": sd[f"{sa}.o_proj.weight"],
        f"{b}.attn_q_norm.weight": sd[f"{sa}.q_norm.weight"] + 1,
        f"{b}.attn_k_norm.weight": sd[f"{sa}.k_norm.weight"] + 1,
    }


def _deepseek2_attention(sd: dict[str, np.ndarray], cfg, p: str, b: str) -> dict[str, np.ndarray]:
    """DeepSeek-V2's MLA: the rope rows of each query head and of the rope key reordered from
    interleaved pairs to halves (evens, then odds), kv_b_proj split per head into attn_k_b
    [H, rank, nope] (transposed) and attn_v_b [H, v, rank]."""
    sa, H = f"{p}.self_attn", cfg.num_attention_heads
    nope, rope, v, rank = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )

    def halves(rows: np.ndarray) -> np.ndarray:  # [..., rope, n] -> evens then odds
        lead, n = rows.shape[:-2], rows.shape[-1]
        pairs = rows.reshape(*lead, rope // 2, 2, n)
        return np.swapaxes(pairs, -3, -2).reshape(*lead, rope, n)

    def query(w: np.ndarray) -> np.ndarray:
        q = w.reshape(H, nope + rope, -1)
        return np.concatenate([q[:, :nope], halves(q[:, nope:])], axis=1).reshape(w.shape)

    kv_a = sd[f"{sa}.kv_a_proj_with_mqa.weight"]
    kv_b = sd[f"{sa}.kv_b_proj.weight"].reshape(H, nope + v, rank)
    out = {
        f"{b}.attn_kv_a_mqa.weight": np.concatenate([kv_a[:rank], halves(kv_a[rank:])]),
        f"{b}.attn_kv_a_norm.weight": sd[f"{sa}.kv_a_layernorm.weight"],
        f"{b}.attn_k_b.weight": kv_b[:, :nope].transpose(0, 2, 1),
        f"{b}.attn_v_b.weight": kv_b[:, nope:],
        f"{b}.attn_output.weight": sd[f"{sa}.o_proj.weight"],
    }
    if cfg.q_lora_rank:
        return out | {
            f"{b}.attn_q_a.weight": sd[f"{sa}.q_a_proj.weight"],
            f"{b}.attn_q_a_norm.weight": sd[f"{sa}.q_a_layernorm.weight"],
            f"{b}.attn_q_b.weight": query(sd[f"{sa}.q_b_proj.weight"]),
        }
    return out | {f"{b}.attn_q.weight": query(sd[f"{sa}.q_proj.weight"])}


def _qwen35_ffn(sd: dict[str, np.ndarray], p: str, b: str) -> dict[str, np.ndarray]:
    gu, down = sd[f"{p}.mlp.experts.gate_up_proj"], sd[f"{p}.mlp.experts.down_proj"]
    ff = down.shape[2]
    gud = np.stack([gu[:, :ff], gu[:, ff:], down.transpose(0, 2, 1)], axis=2)
    out = {
        f"{b}.ffn_gud_exps.weight": gud,
        f"{b}.ffn_gate_inp.weight": sd[f"{p}.mlp.gate.weight"],
        f"{b}.ffn_gate_inp_shexp.weight": sd[f"{p}.mlp.shared_expert_gate.weight"][0],
    }
    for proj in ("gate", "up", "down"):
        out[f"{b}.ffn_{proj}_shexp.weight"] = sd[f"{p}.mlp.shared_expert.{proj}_proj.weight"]
    return out


def _gptoss_layer(sd: dict[str, np.ndarray], p: str, b: str) -> dict[str, np.ndarray]:
    """GPT-OSS's sinks, router bias and experts: gate_up [E, n, 2ff] with gate/up interleaved
    along the last axis (x @ gate_up), down [E, ff, n] (x @ down), biases interleaved too."""
    gu = sd[f"{p}.mlp.experts.gate_up_proj"]
    down = sd[f"{p}.mlp.experts.down_proj"]
    E, n, ff = gu.shape[0], gu.shape[1], down.shape[1]
    gud = np.empty((E, ff, 3, n), np.float32)
    for e in range(E):
        for j in range(ff):
            gud[e, j] = gu[e, :, 2 * j], gu[e, :, 2 * j + 1], down[e, j]
    return {
        f"{b}.attn_sinks.weight": sd[f"{p}.self_attn.sinks"],
        f"{b}.ffn_gate_inp.weight": sd[f"{p}.mlp.router.weight"],
        f"{b}.ffn_gate_inp.bias": sd[f"{p}.mlp.router.bias"],
        f"{b}.ffn_gud_exps.weight": gud,
        f"{b}.ffn_gu_exps.bias": sd[f"{p}.mlp.experts.gate_up_proj_bias"].reshape(E, ff, 2),
        f"{b}.ffn_down_exps.bias": sd[f"{p}.mlp.experts.down_proj_bias"],
    }


def _llama4_layer(sd: dict[str, np.ndarray], cfg, p: str, b: str) -> dict[str, np.ndarray]:
    """Llama-4: q/k rows per head from the interleaved rope pairs (2i, 2i + 1) to rotate_half's
    (i, i + d/2); experts gate_up [E, n, 2ff] (x @ gate_up: gate columns, then up), down
    [E, ff, n]; an ungated shared expert; dense layers under feed_forward."""
    d = cfg.head_dim
    order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    out = {}
    for proj in ("q", "k"):
        w = sd[f"{p}.self_attn.{proj}_proj.weight"]
        out[f"{b}.attn_{proj}.weight"] = w.reshape(-1, d, w.shape[-1])[:, order].reshape(w.shape)
    ff_mod = f"{p}.feed_forward"
    if f"{ff_mod}.experts.gate_up_proj" not in sd:
        for proj in ("gate", "up", "down"):
            out[f"{b}.ffn_{proj}.weight"] = sd[f"{ff_mod}.{proj}_proj.weight"]
        return out
    gu, down = sd[f"{ff_mod}.experts.gate_up_proj"], sd[f"{ff_mod}.experts.down_proj"]
    ff = down.shape[1]
    gud = np.stack([gu[:, :, :ff].transpose(0, 2, 1), gu[:, :, ff:].transpose(0, 2, 1), down], 2)
    out[f"{b}.ffn_gud_exps.weight"] = gud
    out[f"{b}.ffn_gate_inp.weight"] = sd[f"{ff_mod}.router.weight"]
    for proj in ("gate", "up", "down"):
        out[f"{b}.ffn_{proj}_shexp.weight"] = sd[f"{ff_mod}.shared_expert.{proj}_proj.weight"]
    return out


def _expected_type(name: str, ref: np.ndarray, outtype: str) -> GGMLQuantizationType:
    if ref.ndim == 1 or "ffn_gate_inp" in name or name.endswith(".bias") or "ssm_conv1d" in name:
        return Q.F32  # norms, biases, sinks, routers, shared-expert gate, DeltaNet conv, A
    w = W_TYPE[outtype]
    if w == Q.Q4_0 and name in ("token_embd.weight", "output.weight"):
        w = Q.Q8_0
    if w in (Q.Q8_0, Q.Q4_0) and ref.shape[-1] % 32:
        w = Q.F16
    return w


def _field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    assert field is not None, f"missing key {key}"
    return field.contents()


def _check_tensors(gguf_path: Path, ref: dict[str, np.ndarray], outtype: str) -> None:
    reader = GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(ref)
    for name, t in tensors.items():
        want = ref[name]
        assert [int(d) for d in reversed(t.shape)] == list(want.shape), name
        qtype = _expected_type(name, want, outtype)
        assert t.tensor_type == qtype, (name, t.tensor_type)
        if qtype == Q.F32:
            assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), name
        elif qtype == Q.F16:
            assert np.array_equal(
                np.asarray(t.data).reshape(want.shape), want.astype(np.float16)
            ), name
        else:
            # byte-identical to quantizing the reference rows, and within the format's bound
            data = np.asarray(t.data)
            assert np.array_equal(data, quantize(want, qtype)), name
            got = dequantize(data, qtype)
            assert np.array_equal(got, dequantize(quantize(want, qtype), qtype)), name
            row_max = np.abs(want).max(axis=-1, keepdims=True)
            # Q8_0: |err| <= d/2 (d = blockmax/127); Q4_0: |err| <= d (d = blockmax/8);
            # bf16: relative 2^-8
            bound = {Q.Q8_0: row_max / 127, Q.Q4_0: row_max / 7, Q.BF16: row_max / 128}[qtype]
            assert np.all(np.abs(got - want) <= bound + 1e-7), name


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_match_hf(models_root: Path, tmp_path: Path, arch: str, fused: bool, outtype: str):
    model_dir, ref = _model(models_root, arch, fused)
    out = convert(model_dir, tmp_path / "m.gguf", outtype, progress=False)
    assert out == tmp_path / "m.gguf"
    _check_tensors(out, ref, outtype)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp file left


def test_bf16(models_root: Path, tmp_path: Path):
    model_dir, ref = _model(models_root, "qwen2moe", False)
    _check_tensors(convert(model_dir, tmp_path / "m.gguf", "bf16", progress=False), ref, "bf16")


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata(models_root: Path, tmp_path: Path, arch: str):
    model_dir, _ = _model(models_root, arch, False)
    r = GGUFReader(convert(model_dir, tmp_path / "m.gguf", "q8_0", progress=False))
    cfg = json.loads((model_dir / "config.json").read_text())
    a = GGUF_ARCH[arch]
    n_expert = cfg.get("num_experts") or cfg.get("num_local_experts")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    expect = {
        "general.architecture": a,
        "general.name": model_dir.name,
        "general.file_type": 7,
        "general.quantization_version": 2,
        "pyruntime.layout_version": 1,
        "pyruntime.hf_architecture": cfg["architectures"][0],
        "pyruntime.expert_activation": "swiglu_oai" if arch == "gptoss" else "silu",
        f"{a}.vocab_size": 4096,
        f"{a}.context_length": 256,
        f"{a}.embedding_length": 64,
        f"{a}.block_count": cfg["num_hidden_layers"],
        f"{a}.expert_feed_forward_length": cfg.get("moe_intermediate_size")
        or cfg["intermediate_size"],
        f"{a}.expert_count": n_expert,
        f"{a}.expert_used_count": 1 if arch == "llama4" else 2,
        f"{a}.expert_weights_norm": arch in ("mixtral", "granitemoe", "gptoss", "qwen35moe"),
        f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": 2,
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.rope.freq_base": cfg["rope_parameters"]["rope_theta"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.eot_token_id": 2,  # <|im_end|>
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "pyruntime.stop_token_ids": [0, 2],
    }
    # where llama.cpp's converter writes it: the experts' n_ff, or qwen's dense layers' n_ff
    if arch != "qwen35moe":  # no dense FFN and no intermediate_size
        expect[f"{a}.feed_forward_length"] = cfg["intermediate_size"]
    if arch == "llama4":
        expect |= {
            f"{a}.feed_forward_length": 96,  # intermediate_size_mlp: the dense layers
            f"{a}.expert_shared_feed_forward_length": 32,
            f"{a}.interleave_moe_layer_step": 2,
            f"{a}.attention.nope_layers": [False, True, False, True],
            f"{a}.attention.chunk_size": 8,
            f"{a}.attention.qk_l2_norm": True,
            f"{a}.attention.temperature_length": 4,
            f"{a}.attention.temperature_scale": 0.5,
            f"{a}.rope.scaling.type": "llama3",
            f"{a}.rope.scaling.factor": 8.0,
            f"{a}.rope.scaling.original_context_length": 16,
            f"{a}.rope.scaling.low_freq_factor": 1.0,
            f"{a}.rope.scaling.high_freq_factor": 4.0,
        }
    expect["tokenizer.ggml.pre"] = "gpt-2"  # tokenizer.json: ByteLevel with GPT-2's regex
    if arch == "qwen2moe":
        expect[f"{a}.expert_shared_feed_forward_length"] = 64
    if arch == "qwen35moe":
        expect |= {
            f"{a}.rope.dimension_count": 8,  # 0.25 of head_dim 32
            f"{a}.expert_shared_feed_forward_length": 48,
            f"{a}.attention.recurrent_layers": [True, True, True, False],
            f"{a}.full_attention_interval": 4,
            f"{a}.ssm.conv_kernel": 4,
            f"{a}.ssm.state_size": 16,
            f"{a}.ssm.group_count": 2,
            f"{a}.ssm.time_step_rank": 4,
            f"{a}.ssm.inner_size": 96,
        }
    if arch == "granitemoe":
        expect |= {
            f"{a}.embedding_scale": 12.0,
            f"{a}.residual_scale": pytest.approx(0.22),
            f"{a}.attention.scale": 0.0078125,
            f"{a}.logit_scale": 6.0,
        }
    if arch == "deepseek2":
        expect |= {
            f"{a}.expert_count": 8,
            f"{a}.attention.head_count_kv": 1,
            f"{a}.attention.key_length": 32 + 16,  # the cached latent and rope key
            f"{a}.attention.value_length": 32,
            f"{a}.attention.kv_lora_rank": 32,
            f"{a}.attention.key_length_mla": 48,
            f"{a}.attention.value_length_mla": 32,
            f"{a}.rope.dimension_count": 16,
            f"{a}.leading_dense_block_count": 1,
            f"{a}.expert_shared_count": 2,
            f"{a}.expert_shared_feed_forward_length": 64,
            f"{a}.expert_weights_scale": 1.5,
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": 32.0,
            f"{a}.rope.scaling.original_context_length": 8,
            # mscale(32, 1.0) / mscale(32, 0.7); 0.1 mscale_all_dim
            f"{a}.rope.scaling.attn_factor": pytest.approx(1.3466 / 1.24260, rel=1e-4),
            f"{a}.rope.scaling.yarn_log_multiplier": pytest.approx(0.07),
        }
        assert f"{a}.attention.q_lora_rank" not in r.fields
        assert f"{a}.expert_group_count" not in r.fields
    if arch == "gptoss":
        expect |= {
            f"{a}.attention.sliding_window": 8,
            f"{a}.attention.sliding_window_pattern": [True, False],
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": 32.0,
            f"{a}.rope.scaling.original_context_length": 8,
            f"{a}.rope.scaling.yarn_beta_fast": 32.0,
            f"{a}.rope.scaling.yarn_beta_slow": 1.0,
            "pyruntime.rope_yarn_truncate": False,
            "pyruntime.swiglu_alpha": pytest.approx(1.702),
            "pyruntime.swiglu_limit": 7.0,
        }
        # harmony ends a turn at <|return|>, which this tokenizer lacks (test_gptoss.py has it)
        del expect["tokenizer.ggml.eot_token_id"]
        assert "tokenizer.ggml.eot_token_id" not in r.fields
    if arch == "llama4":  # a turn ends at <|eot|>, which this tokenizer lacks (test_llama4.py)
        del expect["tokenizer.ggml.eot_token_id"]
        assert "tokenizer.ggml.eot_token_id" not in r.fields
    for key, value in expect.items():
        assert _field(r, key) == value, key
    assert _field(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert "tokenizer.ggml.bos_token_id" not in r.fields
    # tokenizer: verbatim json, vocab/merges/types from it, chat template from tokenizer_config
    tok_json = (model_dir / "tokenizer.json").read_text()
    assert _field(r, "tokenizer.huggingface.json") == tok_json
    tok = json.loads(tok_json)
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == 4096 and tokens[2] == "<|im_end|>"
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items() if i > 2)
    assert _field(r, "tokenizer.ggml.token_type")[:4] == [3, 3, 3, 1]
    merges = tok["model"]["merges"]
    assert _field(r, "tokenizer.ggml.merges") == [
        m if isinstance(m, str) else " ".join(m) for m in merges
    ]
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert _field(r, "tokenizer.chat_template") == tc["chat_template"]


def test_row_length_fallback_to_f16(tmp_path: Path):
    """hidden 48 is not a multiple of 32: every weight falls back to F16 under Q8_0 (and Q4_0)."""
    model_dir = make_tiny_hf_model("olmoe", tmp_path / "h48", hidden_size=48, intermediate_size=40)
    ref = _reference_tensors("olmoe", model_dir)
    for outtype in ("q8_0", "q4_0"):
        _check_tensors(
            convert(model_dir, tmp_path / f"{outtype}.gguf", outtype, progress=False), ref, outtype
        )


def test_sharded_checkpoint_and_top_level_rope_theta(models_root: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    src, ref = _model(models_root, "mixtral", False)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    shard_dir = tmp_path / "sharded"
    model.save_pretrained(shard_dir, max_shard_size="200KB")
    assert (shard_dir / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, shard_dir / name)
    cfg = json.loads((shard_dir / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 12345.0  # the older config style
    (shard_dir / "config.json").write_text(json.dumps(cfg))
    out = convert(shard_dir, tmp_path / "m.gguf", "f32", progress=False)
    _check_tensors(out, ref, "f32")
    assert _field(GGUFReader(out), "llama.rope.freq_base") == 12345.0


def test_chat_template_jinja_file_wins(models_root: Path, tmp_path: Path):
    src, _ = _model(models_root, "olmoe", False)
    model_dir = shutil.copytree(src, tmp_path / "m")
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    r = GGUFReader(convert(model_dir, tmp_path / "m.gguf", "f16", progress=False))
    assert _field(r, "tokenizer.chat_template") == "{{ messages[0]['content'] }}"


# ---- errors: one-line ConversionError, and never an output file ----


def _broken_copy(models_root: Path, tmp_path: Path, arch: str = "olmoe") -> Path:
    src, _ = _model(models_root, arch, False)
    return shutil.copytree(src, tmp_path / "model")


def _edit_config(model_dir: Path, **changes) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (model_dir / "config.json").write_text(json.dumps(cfg))


def _edit_weights(model_dir: Path, drop: str | None = None, add: str | None = None) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(path)
    if drop:
        del state[drop]
    if add:
        state[add] = torch.zeros(4, 4)
    save_file(state, path, metadata={"format": "pt"})


def _assert_fails(model_dir: Path, tmp_path: Path, *fragments: str) -> str:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError) as info:
        convert(model_dir, out_dir / "m.gguf", "q8_0", progress=False)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert list(out_dir.iterdir()) == []  # no output, no temp file
    return message


def test_unknown_architecture(models_root, tmp_path):
    d = _broken_copy(models_root, tmp_path)
    _edit_config(d, architectures=["FooForCausalLM"])
    msg = _assert_fails(d, tmp_path, "FooForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM")
    assert all(a in msg for a in supported_architectures())


def test_missing_tensor(models_root, tmp_path):
    d = _broken_copy(models_root, tmp_path)
    _edit_weights(d, drop="model.layers.1.mlp.experts.3.up_proj.weight")
    _assert_fails(d, tmp_path, "missing tensors", "model.layers.1.mlp.experts.3.up_proj.weight")


def test_extra_tensor(models_root, tmp_path):
    d = _broken_copy(models_root, tmp_path)
    _edit_weights(d, add="model.layers.0.mlp.mystery.weight")
    _assert_fails(d, tmp_path, "unprocessed tensors", "model.layers.0.mlp.mystery.weight")


def test_shape_mismatch(models_root, tmp_path):
    d = _broken_copy(models_root, tmp_path)
    _edit_config(d, num_key_value_heads=4)
    _assert_fails(d, tmp_path, "k_proj.weight", "shape")


def test_truncated_config(models_root, tmp_path):
    d = _broken_copy(models_root, tmp_path)
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])
    _assert_fails(d, tmp_path, "config.json", "not valid JSON")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"num_experts_per_tok": "two"}, "'num_experts_per_tok' must be an integer"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"rope_parameters": None}, "rope_theta"),
        ({"hidden_act": "relu"}, "hidden_act"),
    ],
)
def test_bad_config_field(models_root, tmp_path, changes, fragment):
    d = _broken_copy(models_root, tmp_path)
    _edit_config(d, **changes)
    _assert_fails(d, tmp_path, fragment)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_missing_file(models_root, tmp_path, name):
    d = _broken_copy(models_root, tmp_path)
    (d / name).unlink()
    _assert_fails(d, tmp_path, name, "missing")


def test_missing_path(tmp_path):
    _assert_fails(tmp_path / "does" / "not" / "exist", tmp_path, "no such folder")


def test_interrupt_leaves_no_partial_file(models_root, tmp_path, monkeypatch):
    from pyruntime.converter import tensors

    model_dir, _ = _model(models_root, "olmoe", False)
    calls = []

    def interrupted(self, fout):
        calls.append(self.out.name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        original(self, fout)

    original = tensors.StreamedTensor.tofile
    monkeypatch.setattr(tensors.StreamedTensor, "tofile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(model_dir, tmp_path / "m.gguf", "f16", progress=False)
    assert len(calls) == 5 and list(tmp_path.iterdir()) == []


# ---- CLI and Hub ----


def _cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "convert_hf_to_gguf.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_error_is_one_line(models_root, tmp_path):
    d = _broken_copy(models_root, tmp_path)
    _edit_config(d, architectures=["FooForCausalLM"])
    proc = _cli([str(d), "--outfile", str(tmp_path / "x.gguf")], cwd=tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "FooForCausalLM" in lines[0]
    assert not (tmp_path / "x.gguf").exists()


def test_cli_ctrl_c_exits_130(monkeypatch, capsys):
    import pyruntime.converter as converter
    from pyruntime.cli import convert_hf as cli

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "convert", interrupt)
    assert cli.main(["some/model"]) == 130


# convert_hf_to_gguf.py with an import that fails: `torch` (the converter's heavy import) or
# `pyruntime.errors` (one of its command line's own), with a Ctrl-C (KeyboardInterrupt) or not
# found (ImportError).
FAILING_IMPORT = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
class Fail:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise {error}
sys.meta_path.insert(0, Fail())
sys.argv = ["convert_hf_to_gguf.py", *{argv!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def _with_failing_import(module: str, error: str, argv: list[str], cwd: Path):
    script = FAILING_IMPORT.format(module=module, error=error, argv=argv,
                                   script=str(REPO / "convert_hf_to_gguf.py"))  # fmt: skip
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=cwd, timeout=120)  # fmt: skip


@pytest.mark.parametrize("module", ["torch", "pyruntime.errors"])
def test_cli_ctrl_c_while_loading_is_one_line(models_root, tmp_path, module):
    """A Ctrl-C while Python loads the converter: one line and 130 (a traceback before)."""
    model_dir, _ = _model(models_root, "olmoe", False)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    argv = [str(model_dir), "--outfile", str(out), "--force"]
    r = _with_failing_import(module, "KeyboardInterrupt", argv, tmp_path)
    assert (r.returncode, r.stderr) == (130, "interrupted; no output written\n")
    assert out.read_bytes() == b"keep me" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_cli_help_and_usage_errors_before_torch(tmp_path):
    """--help and a bad argument are answered before torch is imported (it takes seconds)."""
    r = _with_failing_import("torch", "ImportError('torch was imported')", ["--help"], tmp_path)
    assert r.returncode == 0 and "--outtype" in r.stdout, r.stderr
    r = _with_failing_import("torch", "ImportError('torch was imported')", ["m", "--outtype",
                             "f8"], tmp_path)  # fmt: skip
    assert r.returncode == 2 and "invalid choice: 'f8'" in r.stderr, r.stderr
    assert r.stderr.startswith("error: convert_hf_to_gguf.py: ") and r.stderr.count("\n") == 1


def _fake_hub_cache(cache: Path, repo_id: str, model_dir: Path) -> None:
    """The on-disk layout huggingface_hub's cache uses: models--org--name/{refs,snapshots}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)


def test_cli_hub_repo_id_from_offline_cache(models_root, tmp_path):
    model_dir, ref = _model(models_root, "qwen3moe", True)
    cache = tmp_path / "hf-cache"
    _fake_hub_cache(cache, "tiny-org/tiny-qwen3", model_dir)
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    work = tmp_path / "work"
    work.mkdir()
    proc = _cli(["tiny-org/tiny-qwen3", "--outtype", "f32"], cwd=work, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stderr and "tensors" in proc.stderr  # the summary line
    out = work / "tiny-qwen3-f32.gguf"  # default name: <model-name>-<outtype>.gguf in cwd
    assert [p.name for p in work.iterdir()] == [out.name]
    _check_tensors(out, ref, "f32")
    assert _field(GGUFReader(out), "general.name") == "tiny-org/tiny-qwen3"
    # a repo that is not cached fails cleanly offline
    proc = _cli(["tiny-org/absent", "--outtype", "f32"], cwd=work, env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tiny-org/absent")


def test_bf16_source_weights(models_root: Path, tmp_path: Path):
    """bf16 checkpoints (like the shared tiny models) widen exactly to f32."""
    src, ref = _model(models_root, "olmoe", True)
    model_dir = shutil.copytree(src, tmp_path / "bf16")
    state = load_file(model_dir / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, model_dir / "model.safetensors")
    as_bf16 = {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for k, v in ref.items()}
    _check_tensors(convert(model_dir, tmp_path / "m.gguf", "f32", progress=False), as_bf16, "f32")
