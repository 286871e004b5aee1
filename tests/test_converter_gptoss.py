"""GPT-OSS conversion beyond the shared converter tests (tests/test_converter.py covers its tensors
and metadata): OpenAI's MXFP4 expert storage, and the one-line errors of its own fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from hf_fixtures import make_tiny_hf_model
from safetensors.torch import load_file, save_file

from pyruntime.converter import convert
from pyruntime.converter.mxfp4_source import decode_hf_mxfp4
from pyruntime.errors import ConversionError


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(float checkpoint, MXFP4 checkpoint) of the same random model."""
    root = tmp_path_factory.mktemp("gptoss")
    return (
        make_tiny_hf_model("gptoss", root / "float"),
        make_tiny_hf_model("gptoss", root / "mxfp4", mxfp4_experts=True),
    )


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in GGUFReader(path).tensors}


def test_decode_matches_transformers():
    """OpenAI's MXFP4 encoding (nibble order, E8M0 bias 127) as transformers decodes it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (2, 3, 5), dtype=torch.uint8, generator=g)
    # transformers: [E, rows, G, 16] -> [E, G * 32, rows] (transposed for x @ W)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    for e in range(2):
        got = decode_hf_mxfp4(blocks[e].numpy(), scales[e].numpy(), "w")
        assert np.array_equal(got, want[e].numpy())


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "mxfp4"])
def test_mxfp4_checkpoint_equals_float_checkpoint(checkpoints, tmp_path, outtype):
    """The MXFP4 storage decodes to the model's float weights: the same GGUF, tensor for tensor."""
    float_dir, mxfp4_dir = checkpoints
    a = _tensors(convert(float_dir, tmp_path / "float.gguf", outtype, progress=False))
    b = _tensors(convert(mxfp4_dir, tmp_path / "mxfp4.gguf", outtype, progress=False))
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def _fails(model_dir: Path, tmp_path: Path, *fragments: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError) as info:
        convert(model_dir, out / "m.gguf", "f16", progress=False)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert list(out.iterdir()) == []


def test_broken_scale_block_is_one_line(checkpoints, tmp_path):
    d = shutil.copytree(checkpoints[1], tmp_path / "m")
    state = load_file(d / "model.safetensors")
    state["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 0] = 0xFF
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    _fails(d, tmp_path, "model.layers.1.mlp.experts.down_proj_scales", "0xFF", "[2, 5, 0]")


def test_missing_sinks(checkpoints, tmp_path):
    d = shutil.copytree(checkpoints[0], tmp_path / "m")
    state = load_file(d / "model.safetensors")
    del state["model.layers.0.self_attn.sinks"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    _fails(d, tmp_path, "missing tensors", "model.layers.0.self_attn.sinks")


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
         ("rope type 'linear'", "default, yarn")),
        ({"layer_types": ["full_attention"]}, ("layer_types", "2 layers")),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, ("layer_types",)),
        ({"sliding_window": None}, ("sliding_window",)),
        ({"swiglu_limit": -1.0}, ("swiglu_limit",)),
        ({"quantization_config": {"quant_method": "fp8"}}, ("quantization_config", "mxfp4")),
    ],
)  # fmt: skip
def test_bad_config_field(checkpoints, tmp_path, changes, fragments):
    d = shutil.copytree(checkpoints[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(d, tmp_path, *fragments)


def test_yarn_mscale_refused(checkpoints, tmp_path):
    d = shutil.copytree(checkpoints[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["mscale"] = 0.7
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(d, tmp_path, "rope_parameters.mscale")
