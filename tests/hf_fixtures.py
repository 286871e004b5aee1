"""Tiny random Hugging Face MoE checkpoints for tests (converter, model parity).

`make_tiny_hf_model(arch, path)` builds a deterministic transformers model (hidden 64, 2 layers,
4-8 experts, top-2, 4 heads / 2 kv heads, vocab 4096), saves it in float32 and copies a real
byte-level BPE tokenizer (tests/data/tiny-tokenizer, from the shared tiny-olmoe) next to it.
Storage of the routed experts on disk:
- `fused_experts=False`: `model.save_pretrained` (transformers 5 writes one tensor per expert:
  `mlp.experts.{e}.gate_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.w1.weight`,
  Granite `block_sparse_moe.input_linear.weight`, which is fused by design);
- `fused_experts=True`: `save_file(model.state_dict())`, i.e. transformers 5's in-memory names
  (`mlp.experts.gate_up_proj` [E, 2*ff, hidden], `mlp.experts.down_proj` [E, hidden, ff]).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "tiny-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
ARCHS = ("olmoe", "qwen2moe", "qwen3moe", "mixtral", "granitemoe")

# Shared by all: the tokenizer's special ids (<|endoftext|> = 0 is eos and pad, no bos).
_COMMON: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)

_PER_ARCH: dict[str, dict[str, Any]] = {
    "olmoe": dict(num_experts=8, intermediate_size=32, rope_theta=10000.0),
    "qwen2moe": dict(
        num_experts=8,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        intermediate_size=96,  # the dense layer
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        rope_theta=1000000.0,
    ),
    "qwen3moe": dict(
        num_experts=8,
        moe_intermediate_size=32,
        intermediate_size=96,
        head_dim=32,  # != hidden/heads: exercises key_length
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    ),
    "mixtral": dict(num_local_experts=4, intermediate_size=32, rope_theta=1000000.0),
    "granitemoe": dict(
        num_local_experts=4,
        intermediate_size=32,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=6.0,
        tie_word_embeddings=True,
    ),
}


def _config_class(arch: str) -> type:
    import transformers

    return {
        "olmoe": transformers.OlmoeConfig,
        "qwen2moe": transformers.Qwen2MoeConfig,
        "qwen3moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "granitemoe": transformers.GraniteMoeConfig,
    }[arch]


def make_tiny_hf_model(
    arch: str, path: Path, fused_experts: bool = False, seed: int = 0, **config_overrides: Any
) -> Path:
    """Build and save a tiny random `arch` model in `path` (created); returns `path`."""
    import transformers
    from safetensors.torch import save_file

    if arch not in _PER_ARCH:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    kwargs = {**_COMMON, **_PER_ARCH[arch], **config_overrides}
    config = _config_class(arch)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if fused_experts:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shares storage with embed_tokens
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
    else:
        model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, path / name)
    return path
