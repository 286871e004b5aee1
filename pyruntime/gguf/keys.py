"""The value type of every standard GGUF key, and the check that a file stores each one so.

These are the keys of the GGUF vocabulary (ggml's docs/gguf.md, llama.cpp's llama-arch.cpp) that
a pyruntime file or a llama.cpp file of a supported family may hold, each with the type gguf-py's
writer gives it and llama.cpp's loader demands (it refuses any other: "key ... has wrong type").
`{arch}` stands for the file's `general.architecture`. A key outside the table is not checked
here; a model that reads one checks it where the model is built.
"""

from __future__ import annotations

from collections.abc import Mapping

from gguf import GGUFValueType

from pyruntime.gguf.header import FormatError, Signature, signature_name

V = GGUFValueType
U32, F32, BOOL, STR = (V.UINT32,), (V.FLOAT32,), (V.BOOL,), (V.STRING,)
STRINGS, INT32S, F32S = (V.ARRAY, V.STRING), (V.ARRAY, V.INT32), (V.ARRAY, V.FLOAT32)
BOOLS = (V.ARRAY, V.BOOL)
# feed_forward_length and the head counts may also be per-layer arrays (gguf-py writes a list as
# INT32, llama.cpp's get_key_or_arr reads either)
PER_LAYER = (U32, INT32S, (V.ARRAY, V.UINT32))

STANDARD_KEYS: dict[str, tuple[Signature, ...]] = {
    "general.architecture": (STR,),
    "general.quantization_version": (U32,),
    "general.alignment": (U32,),
    "general.file_type": (U32,),
    **{f"general.{k}": (STR,) for k in (
        "name", "author", "version", "organization", "basename", "finetune", "description",
        "quantized_by", "size_label", "license", "license.name", "license.link", "url", "doi",
        "uuid", "repo_url",
    )},
    **{f"general.{k}": (STRINGS,) for k in ("tags", "languages", "datasets")},
    **{f"{{arch}}.{k}": (U32,) for k in (
        "vocab_size", "context_length", "embedding_length", "block_count",
        "leading_dense_block_count", "expert_feed_forward_length",
        "expert_shared_feed_forward_length", "expert_count", "expert_used_count",
        "expert_shared_count", "expert_gating_func", "attention.key_length",
        "attention.value_length", "attention.sliding_window", "rope.dimension_count",
        "rope.scaling.original_context_length", "full_attention_interval", "ssm.conv_kernel",
        "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
        "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla",
        "attention.value_length_mla", "expert_group_count", "expert_group_used_count",
        "interleave_moe_layer_step", "attention.chunk_size", "attention.temperature_length",
    )},
    **{f"{{arch}}.{k}": PER_LAYER for k in (
        "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    )},
    **{f"{{arch}}.{k}": (F32,) for k in (
        "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "attention.clamp_kqv",
        "attention.scale", "rope.freq_base", "rope.scaling.factor", "embedding_scale",
        "residual_scale", "logit_scale", "expert_weights_scale", "rope.scaling.attn_factor",
        "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_log_multiplier", "attention.temperature_scale",
        "rope.scaling.low_freq_factor", "rope.scaling.high_freq_factor",
    )},
    "{arch}.attention.sliding_window_pattern": (BOOLS,),
    "{arch}.attention.recurrent_layers": (BOOLS,),
    "{arch}.attention.nope_layers": (BOOLS,),
    "{arch}.attention.qk_l2_norm": (BOOL,),
    "{arch}.expert_weights_norm": (BOOL,),
    "{arch}.use_parallel_residual": (BOOL,),
    "{arch}.rope.scaling.type": (STR,),
    "tokenizer.ggml.model": (STR,),
    "tokenizer.ggml.pre": (STR,),
    "tokenizer.ggml.tokens": (STRINGS,),
    "tokenizer.ggml.token_type": (INT32S,),
    "tokenizer.ggml.scores": (F32S,),
    "tokenizer.ggml.merges": (STRINGS,),
    "tokenizer.ggml.added_tokens": (STRINGS,),
    **{f"tokenizer.ggml.{k}_token_id": (U32,) for k in (
        "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask", "cls",
    )},
    **{f"tokenizer.ggml.{k}": (BOOL,) for k in (
        "add_bos_token", "add_eos_token", "add_space_prefix", "remove_extra_whitespaces",
    )},
    "tokenizer.huggingface.json": (STR,),
    "tokenizer.chat_template": (STR,),
}  # fmt: skip


def check_key_types(
    signatures: Mapping[str, Signature],
    table: Mapping[str, tuple[Signature, ...]],
    arch: str | None = None,
) -> None:
    """FormatError for the first key of `table` (with `{arch}` filled in) stored with another
    type than the table allows."""
    for pattern, allowed in table.items():
        if "{arch}" in pattern:
            if arch is None:
                continue
            key = pattern.replace("{arch}", arch)
        else:
            key = pattern
        sig = signatures.get(key)
        if sig is not None and sig not in allowed:
            expected = " or ".join(signature_name(s) for s in allowed)
            raise FormatError(
                f"metadata key '{key}' is stored as {signature_name(sig)}, expected {expected}"
            )
