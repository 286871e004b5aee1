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
GPT-OSS always stores its experts fused (`gate_up_proj` [E, hidden, 2*ff], gate and up
interleaved); `mxfp4_experts=True` writes them as OpenAI's release does (`*_blocks`/`*_scales`,
MXFP4), and the float weights of the model (and of a checkpoint saved without it) are the MXFP4
values, so both conversions describe the same model. Its random weights are rescaled so that the
features are exercised: sinks, biases and expert weights large enough that the SwiGLU clamp
binds, and a sliding window (8) shorter than the parity tests' prompts.
Qwen3.5-MoE: three Gated DeltaNet layers and one full-attention layer (its default pattern),
with its zero-centred norms, decay rates and gates drawn so that each shows (_exercise_qwen35).
Llama-4: dense and MoE layers alternating, NoPE layers with temperature tuning, chunks of 8
(shorter than the prompts), llama3 rope scaling reaching the prompts' positions, top-1 routing
with experts strong enough that the sigmoid weight's place shows (_exercise_llama4).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "tiny-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
ARCHS = (
    "olmoe", "qwen2moe", "qwen3moe", "mixtral", "granitemoe", "gptoss", "qwen35moe", "deepseek2",
    "llama4",
)  # fmt: skip

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
    "gptoss": dict(
        num_local_experts=4,
        intermediate_size=32,
        head_dim=16,
        sliding_window=8,  # layer_types default: layer 0 sliding, layer 1 full
        # YaRN as gpt-oss-20b has it, with an original context of 8 (x 32 = max positions), so
        # that the prompts' positions reach where the scaled frequencies differ
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=8,
        ),
    ),
    "qwen35moe": dict(
        num_hidden_layers=4,  # layer_types default: 3 Gated DeltaNet layers, then full attention
        num_experts=8,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        head_dim=32,
        # DeltaNet heads: 2 key heads of 16, 4 value heads of 24 (each key head read by two)
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    # deepseek-v2-lite's form: no q_lora_rank, greedy routing, the first layer dense, 2 shared
    # experts, YaRN with mscale (an original context of 8 x 32, so the prompts reach the scaled
    # frequencies, and mscale != mscale_all_dim so both of its factors show)
    "deepseek2": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,  # transformers repeats the expanded per-head k/v by H / this
        n_routed_experts=8,
        n_shared_experts=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        routed_scaling_factor=1.5,
        topk_method="greedy",
        norm_topk_prob=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=32.0,
            mscale=1.0,
            mscale_all_dim=0.7,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=8,
        ),
    ),
    "llama4": dict(
        num_hidden_layers=4,  # layers 1 and 3 MoE, 0 and 2 dense; 1 and 3 NoPE
        num_experts_per_tok=1,
        num_local_experts=4,
        intermediate_size=32,  # the experts and the shared expert
        intermediate_size_mlp=96,  # the dense layers
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        head_dim=16,
        attention_chunk_size=8,  # shorter than the parity tests' prompts
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,  # the NoPE layers' q scale grows over the prompt (x 2.4 at 64 tokens)
        attn_scale=0.5,
        # llama3 scaling with an original context of 16: the frequencies of wavelength past 16
        # are divided by 8, those between 4 and 16 smoothed
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
}
# DeepSeek-V2's other form (make_tiny_hf_model("deepseek2", path, **DEEPSEEK2_FULL)): a query
# LoRA and group-limited routing (deepseek-v2's own config), the top-2 within the best of 2
# groups of 4 experts (with top-2 of 8 in 2 of 4 groups, the groups could never change the pick)
DEEPSEEK2_FULL: dict[str, Any] = dict(
    q_lora_rank=64, topk_method="group_limited_greedy", n_group=2, topk_group=1
)


def _config_class(arch: str) -> type:
    import transformers

    return {
        "olmoe": transformers.OlmoeConfig,
        "qwen2moe": transformers.Qwen2MoeConfig,
        "qwen3moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "granitemoe": transformers.GraniteMoeConfig,
        "gptoss": transformers.GptOssConfig,
        "qwen35moe": transformers.Qwen3_5MoeTextConfig,
        "deepseek2": transformers.DeepseekV2Config,
        "llama4": transformers.Llama4TextConfig,
    }[arch]


def make_tiny_hf_model(
    arch: str,
    path: Path,
    fused_experts: bool = False,
    seed: int = 0,
    mxfp4_experts: bool = False,
    **config_overrides: Any,
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
    if arch == "gptoss":
        _exercise_gptoss(model)
    if arch == "qwen35moe":
        _exercise_qwen35(model)
    if arch == "deepseek2":
        _exercise_deepseek2(model)
    if arch == "llama4":
        _exercise_llama4(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if mxfp4_experts:
        _save_mxfp4(model, path)
    elif fused_experts:
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


@torch.no_grad()
def _exercise_gptoss(model) -> None:
    """Weights whose features show: sinks of a few units, nonzero biases, gate/up pre-activations
    of std ~4 (so |gate|, |up| > limit = 7 for some neurons), experts exactly MXFP4-representable
    (so an MXFP4 checkpoint of the same model decodes to these very floats)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.sinks.normal_(0.0, 1.0)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.bias.normal_(0.0, 0.1)
        mlp.router.bias.normal_(0.0, 0.5)
        ex = mlp.experts
        ex.gate_up_proj.normal_(0.0, 0.5)
        ex.gate_up_proj_bias.normal_(0.0, 1.0)
        ex.down_proj.normal_(0.0, 0.05)
        ex.down_proj_bias.normal_(0.0, 0.1)
        # [E, n, 2ff] rows along n, [E, ff, n] rows along ff: MXFP4 blocks as the checkpoint has
        ex.gate_up_proj.copy_(_mxfp4_round(ex.gate_up_proj.transpose(1, 2)).transpose(1, 2))
        ex.down_proj.copy_(_mxfp4_round(ex.down_proj.transpose(1, 2)).transpose(1, 2))


@torch.no_grad()
def _exercise_qwen35(model) -> None:
    """Zero-centred norm weights away from 0 (so the written 1 + w differs from w), decay rates
    and step biases that make exp(g) range over (0, 1), conv and gate weights of unit scale."""
    for p in model.parameters():
        if p.ndim == 1:
            p.normal_(0.0, 0.3)
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            la = layer.linear_attn
            la.A_log.uniform_(-2.0, 1.5)
            la.dt_bias.normal_(0.0, 1.0)
            la.conv1d.weight.normal_(0.0, 0.5)
            la.norm.weight.normal_(1.0, 0.3)
        layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.5)
    model.model.norm.weight.normal_(1.0, 0.3)  # written ~2: logits of unit scale, as the others'


@torch.no_grad()
def _exercise_deepseek2(model) -> None:
    """Norm weights away from 1 (kv_a_layernorm and q_a_layernorm scale the latents) and
    routers of unit-scale logits, so the groups and the top-k differ by token."""
    for p in model.parameters():
        if p.ndim == 1:
            p.normal_(1.0, 0.3)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.weight.normal_(0.0, 0.3)


@torch.no_grad()
def _exercise_llama4(model) -> None:
    """Routed experts that matter: router logits of a few units (sigmoid weights spread over
    (0, 1)) and expert pre-activations of unit scale, so that weighting an expert's input
    differs clearly from weighting its output (SiLU is far from linear there); their outputs
    small beside the token's embedding, so that top-1 gaps stay clear (q8_0 argmax agreement
    measures quantization, not ties)."""
    for layer in model.model.layers:
        if layer.is_moe_layer:
            ff = layer.feed_forward
            ff.router.weight.normal_(0.0, 0.3)
            ff.experts.gate_up_proj.normal_(0.0, 0.3)
            ff.experts.down_proj.normal_(0.0, 0.01)
    # the token's own embedding strong in the residual (tied embeddings: clear top-1 gaps)
    model.model.embed_tokens.weight.normal_(0.0, 0.1)


def _mxfp4_round(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K % 32 == 0) rounded to MXFP4 blocks of 32 along K (gguf-py's quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q = quantize(w.contiguous().numpy(), GGMLQuantizationType.MXFP4)
    return torch.from_numpy(dequantize(q, GGMLQuantizationType.MXFP4)).reshape(w.shape)


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, K] exactly MXFP4-representable -> (blocks uint8 [..., rows, K/32, 16],
    scales uint8 [..., rows, K/32]) in OpenAI's encoding (element 2i low nibble of byte i)."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1)
    # the largest e2m1 magnitude is 6 = 1.5 * 2^2: scale 2^(floor(log2 amax) - 2)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
    scaled = g / torch.exp2(exp)[..., None]
    lut = torch.tensor(_E2M1)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    codes = torch.where((scaled == 0) & (codes == 8), torch.zeros_like(codes), codes)
    if not torch.equal(lut[codes.long()] * torch.exp2(exp)[..., None], g):
        raise AssertionError("weights are not MXFP4-representable")
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def _save_mxfp4(model, path: Path) -> None:
    """The checkpoint as OpenAI ships it: experts as MXFP4 blocks and scales."""
    from safetensors.torch import save_file

    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # stored [E, out rows, in] (transposed from the module's x @ W)
            blocks, scales = _hf_mxfp4(t.transpose(1, 2))
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        else:
            state[name] = t.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.quantization_config = {"quant_method": "mxfp4"}
    model.config.save_pretrained(path)


# A harmony-format chat template (OpenAI's format for gpt-oss: a system header, the developer's
# instructions and tools, channels, tool calls), written for these tests with the jinja features
# gpt-oss's own template uses: recursive macros, namespace(), loop.index slicing, `is defined` on
# kwargs never passed, tojson, strftime_now, raise_exception.
HARMONY_TEMPLATE = """\
{%- macro type_of(spec) -%}
    {%- if spec.type == "array" -%}{{ type_of(spec["items"]) ~ "[]" }}
    {%- elif spec.type == "integer" -%}number
    {%- elif spec.enum is defined -%}{{ '"' ~ spec.enum | join('" | "') ~ '"' }}
    {%- else -%}{{ spec.type | default("any") }}{%- endif -%}
{%- endmacro -%}
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{{- "<|start|>system<|message|>You are a test model.\\nCurrent date: " + strftime_now("%Y-%m-%d")
    + "\\n\\nReasoning: " + reasoning_effort + "\\n\\n# Valid channels: analysis, commentary,"
    + " final.<|end|>" }}
{%- if messages[0].role in ("system", "developer") %}
    {%- set developer = messages[0].content %}{%- set turns = messages[1:] %}
{%- else %}
    {%- set developer = "" %}{%- set turns = messages %}
{%- endif %}
{%- if developer or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer %}{{- "# Instructions\\n\\n" + developer + "\\n\\n" }}{%- endif %}
    {%- if tools %}
        {{- "# Tools\\n\\nnamespace functions {\\n" }}
        {%- for tool in tools %}
            {%- set f = tool.function %}
            {{- "type " + f.name + " = (_: {" }}
            {%- for name, spec in f.parameters.properties.items() %}
                {{- name ~ ": " ~ type_of(spec) }}{{- ", " if not loop.last }}
            {%- endfor %}
            {{- "}) => any;\\n" }}
        {%- endfor %}
        {{- "} // namespace functions" }}
    {%- endif %}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for m in turns %}
    {%- if m.role == "assistant" %}
        {%- if "<|channel|>" in m.content %}
            {{- raise_exception("put the analysis in 'thinking', not in 'content'") }}
        {%- endif %}
        {%- if m.tool_calls is defined %}
            {%- set later = namespace(final=false) %}
            {%- for n in turns[loop.index:] %}
                {%- if n.role == "assistant" and n.tool_calls is not defined %}
                    {%- set later.final = true %}
                {%- endif %}
            {%- endfor %}
            {%- set call = m.tool_calls[0].function %}
            {%- if m.thinking is defined and not later.final %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + call.name
                + "<|channel|>commentary json<|message|>" + call.arguments | tojson + "<|call|>" }}
            {%- set last_call.name = call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" }}
        {%- endif %}
    {%- elif m.role == "tool" %}
        {%- if last_call.name is none %}
            {{- raise_exception("a tool message without a tool call before it") }}
        {%- endif %}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>"
            + m.content | tojson + "<|end|>" }}
    {%- else %}
        {{- "<|start|>user<|message|>" + m.content + "<|end|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}
"""


def _with_chat_tokens(arch: str, path: Path, vocab_size: int, tokens: tuple[str, ...],
                      tokenizer_config: dict, generation: dict) -> Path:  # fmt: skip
    """make_tiny_hf_model(arch) at path with vocab_size ids, `tokens` added to its tokenizer as
    special tokens at ids 4096.. (after the tiny tokenizer's), and its tokenizer_config.json and
    generation_config.json updated with the given keys."""
    import json

    make_tiny_hf_model(arch, path, vocab_size=vocab_size)
    tok = json.loads((path / "tokenizer.json").read_text())
    tok["added_tokens"] += [
        dict(id=4096 + i, content=text, single_word=False, lstrip=False, rstrip=False,
             normalized=False, special=True)
        for i, text in enumerate(tokens)
    ]  # fmt: skip
    (path / "tokenizer.json").write_text(json.dumps(tok))
    for name, update in (("tokenizer_config.json", tokenizer_config),
                         ("generation_config.json", generation)):  # fmt: skip
        config = json.loads((path / name).read_text())
        config.update(update)
        (path / name).write_text(json.dumps(config))
    return path


# harmony's special tokens (gpt-oss's o200k_harmony has them at ids 199998..200018), here after
# the tiny tokenizer's 4096
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")


def make_harmony_model(path: Path) -> Path:
    """A tiny gpt-oss whose tokenizer is harmony's like the real one: its special tokens added
    (ids 4096..4101, vocab 4104), eos <|return|>, generation stopping at <|return|>,
    <|endoftext|> and <|call|> (gpt-oss-20b's generation_config.json), HARMONY_TEMPLATE."""
    ret, call = 4096 + HARMONY_TOKENS.index("<|return|>"), 4096 + HARMONY_TOKENS.index("<|call|>")
    return _with_chat_tokens("gptoss", path, 4104, HARMONY_TOKENS,
                             dict(eos_token="<|return|>", chat_template=HARMONY_TEMPLATE),
                             dict(eos_token_id=[ret, 0, call]))  # fmt: skip


# A Qwen3.5-style chat template (ChatML with thinking, tool calls as <tool_call> JSON, tool
# responses folded into user turns, image/video items of multimodal content), written for these
# tests with the jinja features Qwen3.5's own template uses: namespace(), a reversed slice,
# `is string` / `is mapping` tests, str methods (startswith, split, rstrip, lstrip), a loop over
# a mapping's items(), `is defined` on kwargs never passed, tojson, raise_exception.
QWEN35_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}{{ content }}
    {%- else -%}
        {%- for item in content -%}
            {%- if item.type == "image" -%}<|vision_start|><|image_pad|><|vision_end|>
            {%- elif item.type == "video" -%}<|vision_start|><|video_pad|><|vision_end|>
            {%- elif item.type == "text" -%}{{ item.text }}
            {%- else -%}{{ raise_exception("unknown content item type " ~ item.type) }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- "<|im_start|>system\\n" }}
    {%- if messages[0].role == "system" %}
        {{- render_content(messages[0].content) + "\\n\\n" }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" + tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == "system" %}
    {{- "<|im_start|>system\\n" + render_content(messages[0].content) + "<|im_end|>\\n" }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
        and not (message.content.startswith("<tool_response>")) %}
        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- "<|im_start|>" + message.role + "\\n" + content + "<|im_end|>\\n" }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = "" %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif "</think>" in content %}
            {%- set reasoning = content.split("</think>")[0].rstrip("\\n") %}
            {%- set reasoning = reasoning.split("<think>")[-1].lstrip("\\n") %}
            {%- set content = content.split("</think>")[-1].lstrip("\\n") %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- "<|im_start|>assistant\\n<think>\\n" + reasoning.strip("\\n") + "\\n</think>\\n\\n"
                + content.lstrip("\\n") }}
        {%- else %}{{- "<|im_start|>assistant\\n" + content }}{%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function if tool_call.function else tool_call %}
                {{- "\\n" if (loop.first and content) or not loop.first }}
                {{- "<tool_call>\\n{\\"name\\": \\"" + call.name + "\\", \\"arguments\\": " }}
                {%- if call.arguments is string %}{{- call.arguments }}
                {%- else %}{{- "{" }}
                    {%- for key, value in call.arguments.items() %}
                        {{- key | tojson + ": " + value | tojson }}{{- ", " if not loop.last }}
                    {%- endfor %}{{- "}" }}
                {%- endif %}
                {{- "}\\n</tool_call>" }}
            {%- endfor %}
        {%- endif %}
        {{- "<|im_end|>\\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- "<|im_start|>user" }}
        {%- endif %}
        {{- "\\n<tool_response>\\n" + content + "\\n</tool_response>" }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- "<|im_end|>\\n" }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- "<think>\\n\\n</think>\\n\\n" }}
    {%- else %}{{- "<think>\\n" }}{%- endif %}
{%- endif %}
"""
QWEN35_TOKENS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip


def make_qwen35_chat_model(path: Path) -> Path:
    """A tiny qwen35moe whose tokenizer has Qwen3.5's chat tokens (ids 4096..4105, vocab 4112),
    eos <|im_end|> (its generation stops there and at <|endoftext|>), QWEN35_TEMPLATE."""
    return _with_chat_tokens("qwen35moe", path, 4112, QWEN35_TOKENS,
                             dict(eos_token="<|im_end|>", chat_template=QWEN35_TEMPLATE),
                             dict(eos_token_id=[2, 0]))  # fmt: skip


# deepseek-v2-lite-chat's chat template (its tokenizer_config.json, verbatim): the turns as
# "User: ...\n\n" and "Assistant: ...<｜end▁of▁sentence｜>", a system prompt as a bare paragraph,
# bos_token first
DEEPSEEK2_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)
DEEPSEEK2_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")


def make_deepseek2_chat_model(path: Path) -> Path:
    """A tiny deepseek2 whose tokenizer has DeepSeek's bos and eos (ids 4096, 4097, vocab 4098),
    added at the start of a prompt, eos ending a turn and the generation, DEEPSEEK2_TEMPLATE."""
    tokenizer_config = dict(bos_token=DEEPSEEK2_TOKENS[0], eos_token=DEEPSEEK2_TOKENS[1],
                            add_bos_token=True, chat_template=DEEPSEEK2_TEMPLATE)  # fmt: skip
    return _with_chat_tokens("deepseek2", path, 4098, DEEPSEEK2_TOKENS, tokenizer_config,
                             dict(bos_token_id=4096, eos_token_id=4097))  # fmt: skip


# A Llama-4-style chat template (headers, <|eot|> closing each message, tool calls as JSON
# between <|python_start|> and <|python_end|>, tool results as ipython turns, images as
# <|image|>), written for these tests with the jinja features Llama-4's own template uses:
# bos_token, `is defined` on kwargs never passed, strftime_now, `is string` / `is mapping`,
# trim, a sliced messages list, tojson.
LLAMA4_TEMPLATE = """\
{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0].role == "system" %}
    {%- if messages[0].content is string %}{%- set system_message = messages[0].content | trim %}
    {%- else %}{%- set system_message = messages[0].content[0].text | trim %}{%- endif %}
    {%- set messages = messages[1:] %}
    {{- "<|header_start|>system<|header_end|>\\n\\n" }}
    {%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
    {{- system_message + "<|eot|>" }}
{%- endif %}
{%- if tools is not none %}
    {{- "<|header_start|>user<|header_end|>\\n\\nToday is " + date_string
        + ". Call a function by answering with its name and parameters as JSON.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) + "\\n\\n" }}{%- endfor %}
    {{- "<|eot|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "tool" or message.role == "ipython" %}
        {{- "<|header_start|>ipython<|header_end|>\\n\\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot|>" }}
    {%- elif message.tool_calls is defined and message.tool_calls %}
        {{- "<|header_start|>assistant<|header_end|>\\n\\n<|python_start|>" }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": '
                + call.function.arguments | tojson + "}" }}
        {%- endfor %}
        {{- "<|python_end|><|eot|>" }}
    {%- else %}
        {{- "<|header_start|>" + message.role + "<|header_end|>\\n\\n" }}
        {%- if message.content is string %}{{- message.content }}
        {%- else %}
            {%- for item in message.content %}
                {%- if item.type == "image" %}{{- "<|image|>" }}
                {%- elif item.type == "text" %}{{- item.text }}{%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- "<|eot|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|header_start|>assistant<|header_end|>\\n\\n" }}{%- endif %}
"""
LLAMA4_TOKENS = (
    "<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>",
    "<|python_start|>", "<|python_end|>", "<|image|>",
)  # fmt: skip


def make_llama4_chat_model(path: Path) -> Path:
    """A tiny llama4 whose tokenizer has Llama-4's chat tokens (ids 4096..4103, vocab 4104),
    bos <|begin_of_text|> (the template writes it), eos <|eot|>, generation stopping at <|eot|>,
    <|eom|> and <|endoftext|> (as Llama-4-Scout-Instruct's generation_config.json lists its
    three), LLAMA4_TEMPLATE."""
    tokenizer_config = dict(bos_token="<|begin_of_text|>", eos_token="<|eot|>",
                            chat_template=LLAMA4_TEMPLATE)  # fmt: skip
    return _with_chat_tokens("llama4", path, 4104, LLAMA4_TOKENS, tokenizer_config,
                             dict(eos_token_id=[4099, 4100, 0]))  # fmt: skip
