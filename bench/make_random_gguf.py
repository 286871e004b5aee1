"""A random-weight GGUF of a real model's shape, for speed tests at real sizes.

The file follows docs/gguf-layout.md exactly because it is planned by the converter itself
(pyruntime.converter): a config.json of the named model drives the architecture class, which
gives every metadata key, tensor name, shape and type; only the weight bytes are random. They are
written tensor by tensor in chunks (valid Q8_0/Q4_0 blocks: uniform quants, one fixed scale per
format; std ~0.02 like an initialized model), so memory stays at one chunk whatever the model size.
The tokenizer is tests/data/tiny-tokenizer (the trained tiny-olmoe's), padded to the model's vocab
size as the layout says, so prompts tokenize and the runtime can decode.

`--layout llama.cpp` writes the same shapes in llama.cpp's layout instead, for llama-bench
(bench/peers.py): the routed experts as ffn_gate_exps / ffn_up_exps [n_expert, n_ff, n_embd] and
ffn_down_exps [n_expert, n_embd, n_ff] (gpt-oss: their biases ffn_gate_exps.bias /
ffn_up_exps.bias [n_expert, n_ff] too, and ffn_norm named post_attention_norm),
`{arch}.feed_forward_length` set as llama.cpp's converter sets it, and no pyruntime.* keys
(pyruntime repacks it on first use, as any llama.cpp GGUF of a family its repack knows).

    python bench/make_random_gguf.py olmoe-1b-7b --outtype q8_0 -o /tmp/olmoe-q8_0.gguf
    python bench/make_random_gguf.py olmoe-1b-7b --layout llama.cpp -o /tmp/olmoe-lcpp.gguf
    python bench/make_random_gguf.py gpt-oss-20b --outtype mxfp4 -o /tmp/gpt-oss-20b-mxfp4.gguf
    python bench/make_random_gguf.py qwen3.5-35b-a3b --outtype q4_0 -o /tmp/qwen3.5-35b-q4_0.gguf
    python bench/make_random_gguf.py deepseek-v2-lite --outtype q8_0 -o /tmp/dsv2-lite-q8_0.gguf
    python bench/make_random_gguf.py llama-4-scout --outtype q4_0 -o /tmp/llama-4-scout-q4_0.gguf

qwen35moe's llama.cpp twin also joins attn_q and attn_gate of a full-attention layer into one
attn_q (llama.cpp's), names ffn_norm post_attention_norm and adds rope.dimension_sections;
pyruntime's repack does not read that family (it refuses the file in one line). deepseek2's twin
has our names already (they are llama.cpp's: attn_kv_a_mqa, attn_k_b, attn_v_b, ...) but for the
split experts; llama.cpp rotates its rope dims as interleaved pairs, random data either way.
llama4's twin leaves out the llama3 rope scaling keys (llama.cpp reads the scaling as a rope_freqs
tensor); llama.cpp hard-codes Llama-4's chunk (8192) and NoPE interval (4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
from pyruntime.converter import architectures, deepseek2, gpt_oss, llama4, qwen35  # noqa: E402, F401
from pyruntime.converter.base import model_class_for  # noqa: E402
from pyruntime.converter.convert import _write_metadata  # noqa: E402
from pyruntime.converter.hparams import HParams  # noqa: E402
from pyruntime.converter.tensors import OUTTYPES, choose_qtype, tensor_nbytes  # noqa: E402
from pyruntime.converter.vocab import load_vocab  # noqa: E402

Q = GGMLQuantizationType

# config.json of each model (the fields the converter reads), from the models' Hub configs.
CONFIGS: dict[str, dict] = {
    "granite-1b-a400m": {  # ibm-granite/granite-3.0-1b-a400m-base
        "architectures": ["GraniteMoeForCausalLM"],
        "vocab_size": 49155,
        "hidden_size": 1024,
        "intermediate_size": 512,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625,
        "logits_scaling": 6.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
    "tiny-olmoe": {  # the trained demo model's shape (shared/models/tiny-olmoe): quick checks
        "architectures": ["OlmoeForCausalLM"],
        "vocab_size": 4096,
        "hidden_size": 192,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "olmoe-1b-7b": {  # allenai/OLMoE-1B-7B-0924
        "architectures": ["OlmoeForCausalLM"],
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "qwen1.5-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B
        "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
}

GPT_OSS_LAYERS = ["sliding_attention", "full_attention"]
CONFIGS |= {
    "gpt-oss-20b": {  # openai/gpt-oss-20b
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "sliding_window": 128,
        "layer_types": GPT_OSS_LAYERS * 12,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "tiny-gpt-oss": {  # gpt-oss's features at a quick size (tests)
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 128,
        },
        "sliding_window": 16,
        "layer_types": GPT_OSS_LAYERS,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
}

QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
CONFIGS |= {
    "qwen3.5-35b-a3b": {  # Qwen/Qwen3.5-35B-A3B (its text_config)
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,  # every 4th full attention, the rest Gated DeltaNet
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": QWEN35_ROPE,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "tiny-qwen3.5": {  # qwen3.5's features at a quick size (tests)
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "vocab_size": 4096,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": QWEN35_ROPE,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
}

DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite (the chat model has the same shape)
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,  # the first (dense) layer
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
CONFIGS |= {
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    # its features at a quick size (tests): a latent of 64 + a rope key of 32, 4 heads; a query
    # LoRA (llama.cpp takes a model without one for Lite only by its 27 layers)
    "tiny-deepseek-v2": DEEPSEEK_V2_LITE
    | {
        "q_lora_rank": 64,
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "max_position_embeddings": 4096,
    },
}

# Llama-4-Scout's text model (meta-llama/Llama-4-Scout-17B-16E-Instruct's text_config; the
# values are transformers' Llama4TextConfig defaults): every layer MoE, 16 experts top-1 and a
# shared expert of 8192, every 4th layer NoPE, chunks of 8192 on the others, llama3 rope x16
LLAMA4_TEXT = {
    "architectures": ["Llama4ForCausalLM"],
    "num_key_value_heads": 8,
    "num_experts_per_tok": 1,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192},
    "no_rope_layer_interval": 4,
    "use_qk_norm": True,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}  # fmt: skip
CONFIGS |= {
    "llama-4-scout": LLAMA4_TEXT
    | {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,  # the experts and the shared expert
        "intermediate_size_mlp": 16384,  # dense layers (none in Scout)
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "head_dim": 128,
        "num_local_experts": 16,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192,
        "max_position_embeddings": 10485760,
    },
    "tiny-llama4": LLAMA4_TEXT
    | {  # llama4's features at a quick size (tests): dense layers too
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "interleave_moe_layer_step": 2,
        "no_rope_layer_interval": 2,
        "attention_chunk_size": 8,
        "max_position_embeddings": 4096,
    },
}

WEIGHT_STD = 0.02
CHUNK_BYTES = 64 << 20


class PlanOnlySource:
    """Stands in for converter.sources.SourceTensors: claims every tensor the plan asks for
    (per-expert storage), holds no data. Only the plan is used; the bytes are random."""

    def __contains__(self, name: str) -> bool:
        return not name.endswith(("gate_up_proj", "input_linear.weight"))  # not fused

    def claim(self, name: str, shape: tuple[int, ...] | None = None) -> str:
        return name

    def claim_first(self, candidates, shape=None) -> str:
        return next(iter(candidates))

    def claim_if_present(self, name: str) -> bool:
        return False

    def rename_prefix(self, disk_prefix: str, prefix: str) -> None:
        """Nothing to rename: no checkpoint."""

    def skip_prefix(self, prefix: str) -> None:
        """Nothing to skip: no checkpoint."""


class RandomTensor:
    """Duck-types what GGUFWriter.write_tensor_data uses (nbytes, tofile): random valid bytes of
    one tensor, written in chunks of whole rows."""

    def __init__(self, name: str, shape: tuple[int, ...], qtype: Q, seed: int) -> None:
        self.name, self.shape, self.qtype = name, shape, qtype
        self.nbytes = tensor_nbytes(shape, qtype)
        self.seed = seed

    def tofile(self, fout) -> None:
        rng = np.random.default_rng(self.seed)
        n = self.shape[-1]
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        row_bytes = n // block * block_bytes
        rows = self.nbytes // row_bytes
        step = max(1, CHUNK_BYTES // row_bytes)
        for r0 in range(0, rows, step):
            self._chunk(rng, min(step, rows - r0), n).tofile(fout)

    def _chunk(self, rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
        q = self.qtype
        if q == Q.F32:
            if self.name.endswith("norm.weight"):
                return np.ones((rows, n), np.float32)
            if self.name.endswith(".ssm_a"):  # a DeltaNet's decay rate: negative (state decays)
                return -np.ones((rows, n), np.float32)
            return rng.standard_normal((rows, n), dtype=np.float32) * WEIGHT_STD
        if q in (Q.F16, Q.BF16):
            v = rng.standard_normal((rows, n), dtype=np.float32) * WEIGHT_STD
            if q == Q.F16:
                return v.astype(np.float16)
            return (v.view(np.uint32) >> 16).astype(np.uint16)  # truncation: fine for noise
        if q in (Q.Q8_0, Q.Q4_0):
            block_bytes = 34 if q == Q.Q8_0 else 18
            raw = rng.integers(0, 256, size=(rows, n // 32, block_bytes), dtype=np.uint8)
            if q == Q.Q8_0:
                raw[:, :, 2:] = np.clip(raw[:, :, 2:].view(np.int8), -127, 127).view(np.uint8)
            # std of uniform int8 in [-127, 127] is ~73.3; of (nibble - 8) ~4.61
            d = WEIGHT_STD / (73.3 if q == Q.Q8_0 else 4.61)
            raw[:, :, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
            return raw
        if q in RANDOM_SCALES:  # 5-bit and K-quant blocks: random codes and packed scales
            block, size = GGML_QUANT_SIZES[q]
            raw = rng.integers(0, 256, size=(rows, n // block, size), dtype=np.uint8)
            for at, d in RANDOM_SCALES[q]:
                raw[:, :, at : at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
            return raw
        if q == Q.MXFP4:
            raw = rng.integers(0, 256, size=(rows, n // 32, 17), dtype=np.uint8)
            # uniform e2m1 codes have std ~2.93; scale 2^(120 - 127) gives ~0.023
            raw[:, :, 0] = 120
            return raw
        raise ValueError(f"{self.name}: no random generator for {q.name}")


# (byte offset, f16 value) of the block scales of the 5-bit and K-quant formats, for weights of
# std ~WEIGHT_STD: Q5 codes have std ~9.2; K-quant codes times six-bit sub-block scales
# (mean 31.5) ~145 (Q4_K), ~290 (Q5_K); Q6_K codes times int8 scales ~1360.
RANDOM_SCALES = {
    Q.Q5_0: ((0, WEIGHT_STD / 9.2),),
    Q.Q5_1: ((0, WEIGHT_STD / 9.2), (2, -16 * WEIGHT_STD / 9.2)),
    Q.Q4_K: ((0, WEIGHT_STD / 145), (2, WEIGHT_STD / 250)),
    Q.Q5_K: ((0, WEIGHT_STD / 290), (2, WEIGHT_STD / 250)),
    Q.Q6_K: ((208, WEIGHT_STD / 1360),),
}
TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-tokenizer"
LAYOUTS = ("pyruntime", "llama.cpp")


def llama_cpp_plan(plan: list, arch_name: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor in llama.cpp's layout: each routed-expert tensor
    blk.N.ffn_gud_exps.weight [E, n_ff, 3, n_embd] becomes ffn_gate_exps and ffn_up_exps
    [E, n_ff, n_embd] and ffn_down_exps [E, n_embd, n_ff]; gpt-oss's per-neuron expert biases
    ffn_gu_exps.bias [E, n_ff, 2] become ffn_gate_exps.bias and ffn_up_exps.bias [E, n_ff], its
    ffn_norm post_attention_norm (qwen35moe's too); qwen35moe's full-attention attn_q and
    attn_gate are one attn_q [2 q_rows, n_embd] (per head query rows then gate rows; random
    data either way); every other tensor is the same."""
    out = []
    full_attention = {t.name.removesuffix(".attn_q.weight") for t in plan
                      if t.name.endswith(".attn_q.weight")}  # fmt: skip
    for t in plan:
        if arch_name == "qwen35moe" and t.name.endswith(".attn_q.weight"):
            out.append((t.name, (2 * t.shape[0], t.shape[1]), t.kind))
            continue
        if arch_name == "qwen35moe" and t.name.endswith(".attn_gate.weight"):
            if t.name.removesuffix(".attn_gate.weight") in full_attention:
                continue  # inside attn_q

        if t.name.endswith(".ffn_gu_exps.bias"):
            blk = t.name.removesuffix(".ffn_gu_exps.bias")
            out.append((f"{blk}.ffn_gate_exps.bias", t.shape[:2], t.kind))
            out.append((f"{blk}.ffn_up_exps.bias", t.shape[:2], t.kind))
            continue
        if arch_name in ("gpt-oss", "qwen35moe") and t.name.endswith(".ffn_norm.weight"):
            blk = t.name.removesuffix(".ffn_norm.weight")
            out.append((f"{blk}.post_attention_norm.weight", t.shape, t.kind))
            continue
        if not t.name.endswith(".ffn_gud_exps.weight"):
            out.append((t.name, t.shape, t.kind))
            continue
        blk = t.name.removesuffix(".ffn_gud_exps.weight")
        n_expert, n_ff, _, n_embd = t.shape
        out.append((f"{blk}.ffn_gate_exps.weight", (n_expert, n_ff, n_embd), t.kind))
        out.append((f"{blk}.ffn_up_exps.weight", (n_expert, n_ff, n_embd), t.kind))
        out.append((f"{blk}.ffn_down_exps.weight", (n_expert, n_embd, n_ff), t.kind))
    return out


def to_llama_cpp_metadata(writer: GGUFWriter, arch_name: str, config: dict) -> None:
    """Drop the pyruntime.* keys and add `{arch}.feed_forward_length` where the converter wrote
    none (llama.cpp's converter writes intermediate_size there; OLMoE and Granite-MoE size their
    experts by it)."""
    for kv in writer.kv_data:
        for key in [k for k in kv if k.startswith("pyruntime.")]:
            del kv[key]
    key = f"{arch_name}.feed_forward_length"
    if not any(key in kv for kv in writer.kv_data) and "intermediate_size" in config:
        writer.add_uint32(key, config["intermediate_size"])
    if arch_name == "qwen35moe":  # llama.cpp's loader requires the MRoPE sections (text: unused)
        writer.add_array(f"{arch_name}.rope.dimension_sections", [11, 11, 10, 0])
    if arch_name == "llama4":  # llama.cpp takes llama3 scaling from a rope_freqs tensor (left
        # out: random factors would be no rope at all; the plain rope costs the same)
        for kv in writer.kv_data:
            for key in [k for k in kv if k.startswith(f"{arch_name}.rope.scaling.")]:
                del kv[key]


def make_random_gguf(
    shape: str,
    outfile: Path,
    outtype: str = "q8_0",
    tok_dir: Path | None = None,
    progress: bool = True,
    layout: str = "pyruntime",
) -> Path:
    """Write the random GGUF of `shape` (a key of CONFIGS) in `layout` (LAYOUTS) to outfile;
    returns outfile."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    tok_dir = tok_dir or TOKENIZER_DIR
    config = CONFIGS[shape]
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(config))
        hp = HParams(config, cfg_path)
        hf_arch, model_cls = model_class_for(hp)
        arch = model_cls(hp, PlanOnlySource(), hf_arch)
        plan = arch.tensor_plan()
    vocab = load_vocab(tok_dir, config, arch.n_vocab, arch.end_of_turn_tokens)
    specs = [(t.name, t.shape, t.kind) for t in plan]
    n_layer = 1 + max(int(n.split(".")[1]) for n, _, _ in specs if n.startswith("blk."))
    if layout == "llama.cpp":
        specs = llama_cpp_plan(plan, arch.gguf_arch)
    tensors = [
        RandomTensor(name, shape_, choose_qtype(kind, shape_[-1], outtype, name, n_layer), seed=i)
        for i, (name, shape_, kind) in enumerate(specs)
    ]
    tmp_out = outfile.with_name(f".{outfile.name}.tmp")
    writer = GGUFWriter(tmp_out, arch.gguf_arch)
    start, total = time.perf_counter(), sum(t.nbytes for t in tensors)
    try:
        _write_metadata(writer, arch, vocab, f"random-{shape}", outtype, hf_arch)
        if layout == "llama.cpp":
            to_llama_cpp_metadata(writer, arch.gguf_arch, config)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, shown = 0, -1
        for t in tensors:
            writer.write_tensor_data(t)  # type: ignore[arg-type]  # duck-typed
            done += t.nbytes
            if progress and int(20 * done / total) > shown:
                shown = int(20 * done / total)
                print(f"\r{done / 1e9:.2f} / {total / 1e9:.2f} GB", end="", file=sys.stderr)
        writer.close()
        os.replace(tmp_out, outfile)
    except BaseException:
        writer.close()
        tmp_out.unlink(missing_ok=True)
        raise
    if progress:
        print(
            f"\nwrote {outfile}: {len(tensors)} tensors, {total / 1e9:.2f} GB, "
            f"{time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
    return outfile


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("shape", choices=sorted(CONFIGS))
    p.add_argument("--outtype", default="q8_0", choices=list(OUTTYPES))
    p.add_argument("--layout", default="pyruntime", choices=LAYOUTS)
    p.add_argument("-o", "--outfile", type=Path, default=None)
    p.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="HF folder with tokenizer.json (default: tests/data/tiny-tokenizer)",
    )
    args = p.parse_args()
    out = args.outfile or Path(f"random-{args.shape}-{args.outtype}.gguf")
    make_random_gguf(args.shape, out, args.outtype, args.tokenizer_dir, layout=args.layout)


if __name__ == "__main__":
    main()
