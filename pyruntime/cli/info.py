"""`pyruntime info`: what a GGUF file holds, and where it would run on the GPU."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pyruntime import options
from pyruntime.errors import DeviceMemoryError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "info",
        help="describe a GGUF model file",
        description="Describe a GGUF model file, and where it would run on the GPU: the whole "
        "model, or hybrid (dense weights and KV cache on the GPU, routed experts in host "
        "memory, the rest of the budget as expert slots) under --gpu-mem (default: this "
        "machine's GPU, if any) at a context of -c/--ctx-size tokens.",
    )
    p.add_argument("model", help="GGUF file")
    options.add_arguments(p, "info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.llamacpp_layout import detect_layout

    f = open_gguf(args.model)
    kind = detect_layout(f)
    layout = {
        "pyruntime": "pyruntime",
        "llama.cpp": "llama.cpp (repacked into pyruntime's on first use; `pyruntime repack`)",
        "unknown": "unknown (no routed experts)",
    }[kind]
    quant: dict[str, int] = {}
    for t in f.tensors.values():
        quant[t.qtype.name] = quant.get(t.qtype.name, 0) + 1
    n_params = sum(t.n_elements for t in f.tensors.values())
    tokens = f.get("tokenizer.ggml.tokens", [])
    rows = [
        ("file", str(f.path)),
        ("file size", f"{f.file_size:,} bytes ({_human_bytes(f.file_size)})"),
        ("architecture", f.arch),
        ("layout", layout),
        ("hf architecture", f.get("pyruntime.hf_architecture", _family_class(f))),
        ("name", f.get("general.name", "?")),
        ("parameters", f"{n_params:,} ({_human_count(n_params)})"),
        ("tensors", str(len(f.tensors))),
        ("quant types", ", ".join(f"{k}: {v}" for k, v in sorted(quant.items()))),
        ("layers", str(f.arch_get("block_count", "?"))),
        (
            "experts",
            f"{f.arch_get('expert_count', '?')} (used per token: "
            f"{f.arch_get('expert_used_count', '?')})",
        ),
        ("expert ffn", _expert_ffn(f, kind)),
        ("context length", str(f.arch_get("context_length", "?"))),
        ("embedding size", str(f.arch_get("embedding_length", "?"))),
        (
            "heads (kv)",
            f"{f.arch_get('attention.head_count', '?')} "
            f"({f.arch_get('attention.head_count_kv', '?')})",
        ),
        ("vocab", str(f.arch_get("vocab_size", len(tokens)))),
        ("chat template", "yes" if f.get("tokenizer.chat_template", None) else "no"),
    ]
    rows += _family_rows(f)
    misfit: DeviceMemoryError | None = None
    try:
        if kind == "llama.cpp":
            rows += _repacked_plan_rows(f, args)
        else:
            rows += _gpu_plan_rows(f, args)
    except DeviceMemoryError as exc:  # the file described all the same, then the error
        rows.append(("gpu plan", "does not fit the budget (below)"))
        misfit = exc
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}} : {value}")
    if misfit is not None:
        sys.stdout.flush()
        raise misfit
    return 0


def _expert_ffn(f: Any, kind: str) -> str:
    """Neurons per routed expert: our key, or for a llama.cpp file llama.cpp's reading of its
    keys (some families size the experts by feed_forward_length); '?' where they say nothing."""
    if kind == "llama.cpp":
        from pyruntime.errors import ModelFileError
        from pyruntime.model.llamacpp_layout import LlamaCppHParams

        try:
            return str(LlamaCppHParams.from_gguf(f).n_ff_exp)
        except ModelFileError:
            return "?"
    return str(f.arch_get("expert_feed_forward_length", "?"))


def _family_rows(f: Any) -> list[tuple[str, str]]:
    """What only some families have (the expert activation always): rope scaling, sliding
    windows, attention sinks (gpt-oss)."""
    rows = [("activation", str(f.get("pyruntime.expert_activation", "silu")))]
    if f.arch_get("rope.scaling.type", "none") != "none":
        rows.append((
            "rope scaling",
            f"{f.arch_get('rope.scaling.type')} x{f.arch_get('rope.scaling.factor', '?')} "
            f"(original context {f.arch_get('rope.scaling.original_context_length', '?')})",
        ))  # fmt: skip
    pattern = f.arch_get("attention.sliding_window_pattern", None)
    if pattern is not None:
        rows.append((
            "sliding window",
            f"{f.arch_get('attention.sliding_window', '?')} on {sum(map(bool, pattern))} of "
            f"{len(pattern)} layers",
        ))  # fmt: skip
    if f.has_tensor("blk.0.attn_sinks.weight"):
        rows.append(("attention sinks", "yes"))
    rows += _deltanet_rows(f)
    rows += _mla_rows(f)
    rows += _llama4_rows(f)
    return rows


def _mla_rows(f: Any) -> list[tuple[str, str]]:
    """Multi-head latent attention and DeepSeek's routing (deepseek2): what the cache keeps per
    token, the per-head sizes, the query LoRA, the routing's scale and groups, shared experts
    and leading dense layers."""
    rank = f.arch_get("attention.kv_lora_rank", None)
    if rank is None:
        return []
    rope = f.arch_get("rope.dimension_count", "?")
    qk = f.arch_get("attention.key_length_mla", None)
    nope = qk - rope if isinstance(qk, int) and isinstance(rope, int) else "?"
    attn = (
        f"latent {rank} + rope key {rope} per token; per head {nope} + {rope} key, "
        f"{f.arch_get('attention.value_length_mla', '?')} value dims"
    )
    q_rank = f.arch_get("attention.q_lora_rank", None)
    attn += f"; query LoRA rank {q_rank}" if q_rank else ""
    routing = (
        f"softmax, top-{f.arch_get('expert_used_count', '?')} of "
        f"{f.arch_get('expert_count', '?')}, weights x{f.arch_get('expert_weights_scale', 1.0):g}"
    )
    groups = f.arch_get("expert_group_count", 0)
    if groups:
        routing += (
            f", within the best {f.arch_get('expert_group_used_count', '?')} of {groups} groups"
        )
    n_dense = f.arch_get("leading_dense_block_count", 0)
    shared = (
        f"{f.arch_get('expert_shared_count', 0)} shared (ffn "
        f"{f.arch_get('expert_shared_feed_forward_length', '?')}); "
        + (f"layers 0..{n_dense - 1} dense" if n_dense else "no dense layers")
    )
    return [("latent attention", attn), ("routing", routing), ("experts", shared)]


def _llama4_rows(f: Any) -> list[tuple[str, str]]:
    """llama4: dense/MoE interleave, NoPE layers, attention chunks, q/k L2 norm, temperature
    tuning, the shared expert."""
    nope = f.arch_get("attention.nope_layers", None)
    if nope is None:
        return []
    dense = [
        i
        for i in range(len(nope))
        if not any(
            f.has_tensor(f"blk.{i}.{name}.weight") for name in ("ffn_gud_exps", "ffn_gate_exps")
        )
    ]  # ours, llama.cpp's
    chunk = f.arch_get("attention.chunk_size", 0)
    length = f.arch_get("attention.temperature_length", 0)
    temperature = (
        f"1 + {f.arch_get('attention.temperature_scale', '?')} log(1 + floor((pos + 1) / {length}))"
        if length
        else "off"
    )
    return [
        ("dense ffn layers", f"{', '.join(map(str, dense)) or 'none'} (ffn "
         f"{f.arch_get('feed_forward_length', '?')}; MoE every "
         f"{f.arch_get('interleave_moe_layer_step', '?')})"),
        ("nope layers", ", ".join(str(i) for i, v in enumerate(nope) if v) or "none"),
        ("attention chunk", f"{chunk} tokens on the rope layers" if chunk else "none"),
        ("qk l2 norm", "yes" if f.arch_get("attention.qk_l2_norm", False) else "no"),
        ("nope temperature", temperature),
        ("shared expert ffn", str(f.arch_get("expert_shared_feed_forward_length", "?"))),
        ("routing", "top-k, sigmoid weight on the expert's input"),
    ]  # fmt: skip


def _deltanet_rows(f: Any) -> list[tuple[str, str]]:
    """Gated DeltaNet (qwen35moe): which layers, their heads and conv; partial rope, the
    shared expert."""
    recurrent = f.arch_get("attention.recurrent_layers", None)
    if recurrent is None:
        return []
    n_v = f.arch_get("ssm.time_step_rank", 0)
    v_dim = f.arch_get("ssm.inner_size", 0) // n_v if n_v else "?"
    full = [i for i, r in enumerate(recurrent) if not r]
    return [
        ("linear attention", f"Gated DeltaNet on {sum(map(bool, recurrent))} of "
         f"{len(recurrent)} layers (full attention: {', '.join(map(str, full)) or 'none'})"),
        ("deltanet heads", f"{f.arch_get('ssm.group_count', '?')} key x "
         f"{f.arch_get('ssm.state_size', '?')}, {n_v} value x {v_dim}; conv kernel "
         f"{f.arch_get('ssm.conv_kernel', '?')}"),
        ("rope dims", f"{f.arch_get('rope.dimension_count', '?')} of "
         f"{f.arch_get('attention.key_length', '?')} per head"),
        ("shared expert ffn", str(f.arch_get("expert_shared_feed_forward_length", "?"))),
    ]  # fmt: skip


def _family_class(f: Any) -> str:
    """The Hugging Face class llama.cpp's converter reads for the file's architecture, or '?'."""
    from pyruntime.model.llamacpp_layout import FAMILIES

    family = FAMILIES.get(f.arch)
    return family.hf_architecture if family is not None else "?"


def _repacked_plan_rows(f: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The GPU plan of a llama.cpp file's repacked copy (what would run), once there is a
    current one; info does not repack."""
    from pyruntime.converter.repack_cache import cached_copy_path, is_copy_of
    from pyruntime.gguf.file import open_gguf

    copy = cached_copy_path(f.path)
    if not is_copy_of(copy, f):
        return [("gpu plan", "once repacked (on first use, or `pyruntime repack MODEL`)")]
    return _gpu_plan_rows(open_gguf(copy), args)


def _gpu_plan_rows(f: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Where the model would run under --gpu-mem (default: this machine's GPU's budget) at
    -c/--ctx-size tokens; a line saying so without a budget or a GPU."""
    from pyruntime.model.config import ModelConfig
    from pyruntime.offload.plan import device_bytes, plan_budget

    cfg = ModelConfig.from_gguf(f)
    n_ctx = options.value("n_ctx", args.n_ctx) or cfg.context_length
    budget = options.value("gpu_mem", args.gpu_mem)
    if budget is None:
        if not _may_have_gpu():  # without importing torch (~2 s): info is a quick look
            return [("gpu plan", "no GPU here: give --gpu-mem SIZE for the plan on one")]
        import torch

        if not torch.cuda.is_available():
            return [("gpu plan", "no GPU here: give --gpu-mem SIZE for the plan on one")]
        from pyruntime.placement import gpu_budget

        budget, _ = gpu_budget(torch.device("cuda"), None)
    return plan_budget(device_bytes(f, cfg, n_ctx), budget, n_ctx).rows()


# A GPU driver's device nodes on Linux (NVIDIA's; ROCm's /dev/kfd): without any of them torch
# sees no GPU either.
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd")


def _may_have_gpu() -> bool:
    """False when this is surely a machine without a GPU torch could use (Linux, no driver's
    device node); True elsewhere, where torch must be asked."""
    return not sys.platform.startswith("linux") or any(os.path.exists(p) for p in _GPU_NODES)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_count(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if n < 1000 or unit == "B":
            return f"{n:.2f}{unit}" if unit else str(int(n))
        n /= 1000
    return f"{n:.2f}T"
