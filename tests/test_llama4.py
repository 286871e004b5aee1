"""Llama-4: the converter's fields and refusals, its multimodal layout, the CPU path (the C
decoder), sparsity, the hybrid's plan, and where it is refused (big/little needs top-k >= 2).
The GPU path is in tests/test_gpu_model.py and tests/test_gpu_prefill.py (every family), the
hybrid (offload) path in tests/test_offload_llama4.py.
Logits vs transformers (prefill and token-by-token decode, f32 / q8_0 / mxfp4, both expert
backends) are in tests/test_parity.py (ARCHS); the tiny config (tests/hf_fixtures.py) makes
every feature move the log-probs by more than the 1e-3 tolerance: without the chunk mask, the
q/k L2 norm, the NoPE layers, llama3 scaling or with the sigmoid weight on the expert's output
by 0.50-1.07, without temperature tuning by 0.006.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from calibration_check import check_calibrated_sparsity
from conversion_checks import (
    check_config_refused,
    check_missing_tensor_refused,
    check_text_model_converted,
    multimodal_checkpoint,
)
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor, c_decoder_runs
from pyruntime.errors import UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import attention_mask


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model("llama4", tmp_path_factory.mktemp("l4") / "hf")


@pytest.fixture(scope="module")
def f32_path(hf_dir, tmp_path_factory) -> Path:
    return convert(hf_dir, tmp_path_factory.mktemp("l4g") / "m.gguf", "f32", progress=False)


def test_the_file_holds_the_llama4_fields(f32_path):
    f = open_gguf(f32_path)
    cfg = ModelConfig.from_gguf(f)
    assert cfg.nope_layers == (False, True, False, True)
    assert (cfg.layer_chunk(0), cfg.layer_chunk(1)) == (8, 0)  # NoPE layers attend globally
    assert cfg.qk_l2_norm and cfg.expert_input_weight and not cfg.expert_weights_norm
    assert (cfg.temperature_length, cfg.temperature_scale) == (4, 0.5)
    llama3 = cfg.rope_llama3
    assert (llama3.factor, llama3.low_freq_factor, llama3.high_freq_factor) == (8.0, 1.0, 4.0)
    assert llama3.original_context_length == 16
    # layers 0 and 2 dense (intermediate_size_mlp), 1 and 3 MoE with an ungated shared expert
    model = CpuExecutor.from_gguf(f, expert_backend="torch")
    assert model.moe_layers() == [1, 3]
    assert model.blocks[0].dense_ffn.gate.shape == (96, 64)
    assert model.blocks[1].shared is not None and model.blocks[1].shared_gate is None


def test_chunk_mask():
    """A query sees the earlier keys of its own chunk only (chunks of 3; queries 4..7)."""
    mask = attention_mask(4, 8, chunk=3)
    want = [[k <= q and k // 3 == q // 3 for k in range(8)] for q in range(4, 8)]
    assert mask.tolist() == want


def test_cpu_path_runs_the_c_decoder(f32_path):
    """With the C core the model's prefill and steps are the C decoder's (runtime/src/llama4.c;
    its parity with transformers in tests/test_parity.py, with its own steps in
    tests/test_cpu_prefill.py, seams in tests/test_cpu_decode.py); the reference forward stays
    the torch backend's."""
    model = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="c")
    assert c_decoder_runs(model.config) and model._decoder is not None
    torch_model = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="torch")
    ids = torch.randint(0, model.config.n_vocab, (12,), generator=torch.Generator().manual_seed(2))
    want = torch_model.forward(ids, torch_model.new_cache(12))
    cache = model.new_cache(12)
    got = torch.cat([model.forward(ids[:9], cache)] + [model.forward(ids[j : j + 1], cache)
                                                        for j in range(9, 12)])  # fmt: skip
    err = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
    assert err <= 1e-4, f"C decoder vs the reference: {err:.2e}"


def test_info_shows_the_llama4_fields(f32_path, capsys):
    from pyruntime.cli import main

    assert main(["info", str(f32_path)]) == 0
    # the keys' column is as wide as the longest key, which the placement lines change
    out = capsys.readouterr().out
    fields = dict(re.findall(r"^(\S.*?)\s+: (.*)$", out, re.M))
    assert fields["rope scaling"] == "llama3 x8.0 (original context 16)"
    assert fields["dense ffn layers"] == "0, 2 (ffn 96; MoE every 2)"
    assert fields["nope layers"] == "1, 3"
    assert fields["attention chunk"] == "8 tokens on the rope layers"
    assert fields["qk l2 norm"] == "yes"
    assert "1 + 0.5 log(1 + floor((pos + 1) / 4))" in out


def test_big_little_refuses_top1(f32_path):
    from pyruntime.decoding.mode import DecodingMode

    cfg = ModelConfig.from_gguf(open_gguf(f32_path))
    with pytest.raises(UsageError) as info:
        DecodingMode.from_options(cfg, big_little=True)
    assert "needs a model with top-k >= 2 (this one routes 1 expert" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_budget_below_the_model_runs_hybrid(f32_path, monkeypatch, capsys):
    """The GPU executor runs the model when it fits; a smaller budget plans the hybrid, its
    dense part holding the shared experts and the dense-FFN layers (0 and 2) beside attention;
    a budget below that part is one line."""
    from pyruntime.cli import main
    from pyruntime.errors import DeviceMemoryError
    from pyruntime.offload.plan import EXPERTS_SUFFIX, device_bytes
    from pyruntime.placement import choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tiny GPU")
    f = open_gguf(f32_path)
    cfg = ModelConfig.from_gguf(f)
    assert choose_device("auto", f, cfg, 64).plan is None  # the whole model on the GPU
    need = device_bytes(f, cfg, 64)
    assert need.n_experts == 2 * cfg.n_expert  # the MoE layers' routed experts only
    ffn = [t for t in f.tensors.values()
           if ".ffn_" in t.name and not t.name.endswith(EXPERTS_SUFFIX)]  # fmt: skip
    assert {t.name.split(".")[1] for t in ffn} == {"0", "1", "2", "3"}  # dense FFNs + shexp
    assert need.dense > sum(t.n_elements * 4 for t in ffn)
    small = need.fixed + 2 * need.expert_bytes
    for device in ("auto", "cuda"):
        choice = choose_device(device, f, cfg, 64, gpu_mem=small)
        assert choice.hybrid and choice.plan.slots == 2 and choice.note is None
    with pytest.raises(DeviceMemoryError, match="^--device cuda: the dense weights") as info:
        choose_device("cuda", f, cfg, 64, gpu_mem=need.fixed - 1)
    assert "\n" not in str(info.value)
    assert main(["info", str(f32_path), "--gpu-mem", str(small), "-c", "64"]) == 0
    fields = dict(re.findall(r"^(\S.*?)\s+: (.*)$", capsys.readouterr().out, re.M))
    assert fields["expert slots"].startswith("2 (") and fields["placement"].startswith("hybrid")


# ---- the converter --------------------------------------------------------------------------


def _multimodal(hf_dir: Path, out: Path) -> Path:
    """The same text model as Llama4ForConditionalGeneration stores it: tensors under
    language_model.model. and language_model.lm_head, a vision tower and projector beside it,
    the config nested."""
    from safetensors.torch import load_file

    state = load_file(str(hf_dir / "model.safetensors"))
    tensors = {f"language_model.{k}": v for k, v in state.items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(8, 12)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(64, 8)
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "vision_config": {"num_hidden_layers": 1},
    }
    return multimodal_checkpoint(hf_dir, out, tensors, config)


def test_multimodal_checkpoint_converts_its_text_model(hf_dir, f32_path, tmp_path):
    check_text_model_converted(_multimodal(hf_dir, tmp_path / "mm"), f32_path, tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(hidden_act="gelu"), "'hidden_act' must be silu"),
        (dict(layer_types=["full_attention"] * 4), "'layer_types' must be chunked_attention"),
        (dict(no_rope_layers=[1, 0]), "'no_rope_layers' must list 0 or 1 for each of the 4"),
        (dict(moe_layers=[1, 7]), "'moe_layers' must list layer indices in 0..3"),
        (dict(router_jitter_noise=0.1), "'router_jitter_noise' must be 0"),
        (dict(rope_parameters=dict(rope_theta=1e4, rope_type="yarn", factor=2.0)), "yarn"),
        (
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=1e4,
                    factor=8.0,
                    low_freq_factor=4.0,
                    high_freq_factor=1.0,
                    original_max_position_embeddings=16,
                )
            ),
            "'rope_parameters.high_freq_factor' must be >= low_freq_factor",
        ),  # fmt: skip
    ],
)
def test_unsupported_config_values_are_one_line(hf_dir, tmp_path, config, message):
    check_config_refused(hf_dir, tmp_path, config, message)


def test_a_missing_tensor_is_one_line_and_no_file(hf_dir, tmp_path):
    tensor = "model.layers.3.feed_forward.shared_expert.up_proj"
    check_missing_tensor_refused(hf_dir, tmp_path, tensor + ".weight", tensor)


def test_calibrate_and_sparsity_hit_the_target(hf_dir, tmp_path):
    """`pyruntime calibrate` then --sparsity: thresholds measured on one text (on each expert's
    input as it runs: x * sigmoid(logit)), applied to another, drop the target fraction of
    routed neurons within 3 points (512 tokens x 2 MoE layers x 1 expert x 32 neurons = 33k
    decisions per target), through the C core's prefill and decode step."""
    check_calibrated_sparsity(hf_dir, tmp_path, (0.3, 0.7))


def test_llama3_frequencies_are_transformers():
    """Both the blended band (high > low) and Llama-4's release values (high == low: none)."""
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pyruntime.model.rope import Llama3, inv_frequencies

    for low, high, orig in ((1.0, 4.0, 16), (1.0, 1.0, 8192)):
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=16.0, low_freq_factor=low,
                    high_freq_factor=high, original_max_position_embeddings=orig)  # fmt: skip
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](Llama4TextConfig(head_dim=64, rope_parameters=rope))
        got = inv_frequencies(64, 500000.0, llama3=Llama3(16.0, low, high, orig))
        assert torch.equal(got, want)
        assert not torch.equal(got, inv_frequencies(64, 500000.0))
