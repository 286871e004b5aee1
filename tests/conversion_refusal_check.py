"""The checks every architecture's converter-refusal tests run on its tiny HF checkpoint: an
unsupported config value, or a missing tensor, is refused in one line (ConversionError) and
leaves no output file behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pyruntime.converter import convert
from pyruntime.errors import ConversionError


def edited(hf_dir: Path, tmp_path: Path, **config) -> Path:
    """A copy of the checkpoint at tmp_path/edited with config.json's keys updated by config."""
    out = tmp_path / "edited"
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(config)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def check_config_refused(hf_dir: Path, tmp_path: Path, config: dict, message: str) -> None:
    """The checkpoint with config's values converts to nothing, with one line holding message."""
    src = edited(hf_dir, tmp_path, **config)
    with pytest.raises(ConversionError) as info:
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out.gguf").exists()


def check_missing_tensor_refused(hf_dir: Path, tmp_path: Path, tensor: str,
                                 named: str | None = None) -> None:  # fmt: skip
    """The checkpoint without `tensor` converts to nothing (not even a partial file), with one
    line holding "missing tensors: <named>" (default: the tensor's name)."""
    from safetensors.torch import load_file, save_file

    src = edited(hf_dir, tmp_path)
    state = load_file(str(src / "model.safetensors"))
    del state[tensor]
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError) as info:
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert f"missing tensors: {named or tensor}" in str(info.value)
    assert "\n" not in str(info.value) and list(tmp_path.glob("out.gguf*")) == []
