"""The checks every architecture's converter tests run on its tiny HF checkpoint: an unsupported
config value, or a missing tensor, is refused in one line (ConversionError) and leaves no output
file behind; the multimodal checkpoint of the same text model converts to the same tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pyruntime.converter import convert
from pyruntime.errors import ConversionError
from pyruntime.gguf.file import open_gguf


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


def multimodal_checkpoint(hf_dir: Path, out: Path, tensors: dict, config: dict) -> Path:
    """A multimodal checkpoint at `out` holding hf_dir's text model as its architecture stores
    it: `tensors` (the text model's, renamed, and the other towers'), config.json `config` with
    hf_dir's config (less its architectures) nested as text_config, hf_dir's tokenizer and
    generation files beside them."""
    from safetensors.torch import save_file

    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((hf_dir / "config.json").read_text())
    text.pop("architectures")
    (out / "config.json").write_text(json.dumps({**config, "text_config": text}))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(hf_dir / name, out / name)
    return out


def check_text_model_converted(mm_dir: Path, f32_path: Path, tmp_path: Path) -> None:
    """The multimodal checkpoint mm_dir converts to the text model's tensors (f32_path's, same
    names and order, bit for bit) and records its own architecture."""
    mm = convert(mm_dir, tmp_path / "mm.gguf", "f32", False)
    a, b = open_gguf(f32_path), open_gguf(mm)
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        assert bytes(t.data) == bytes(b.tensors[name].data), name
    architecture = json.loads((mm_dir / "config.json").read_text())["architectures"][0]
    assert b.get("pyruntime.hf_architecture") == architecture
