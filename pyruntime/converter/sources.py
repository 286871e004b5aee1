"""The checkpoint's tensors on disk, read lazily, with bookkeeping of what was used.

`SourceTensors` indexes every tensor name of a (possibly sharded) safetensors checkpoint without
reading any data: shapes come from the safetensors headers. Architecture classes *claim* the
names they map while the conversion plan is built; afterwards `check_complete()` refuses a
checkpoint with missing names or with names nobody claimed (llama.cpp's "unprocessed tensors").
Data is read only when a tensor is written, one tensor (or one expert) at a time, so memory
stays bounded by the largest single tensor, never the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from pyruntime.errors import ConversionError

# Buffers some exporters save that carry no weights (recomputed at load time).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _name_list(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class SourceTensors:
    """Name -> shard index of a safetensors checkpoint, with claim tracking."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}  # numpy-framework handles (headers, f32/f16 data)
        self._torch_handles: dict[Path, Any] = {}  # only for bf16 data, which numpy cannot hold
        self.claimed: set[str] = set()
        self.missing: list[str] = []
        self._disk_name: dict[str, str] = {}  # a renamed tensor's name in the safetensors file
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = self._files_from_index(index)
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ConversionError(
                f"{model_dir}: no *.safetensors weights found (pytorch_model.bin is not "
                "supported); re-save the model with safetensors"
            )
        for path in files:
            for name in self._open(path).keys():
                if name in self._file_of:
                    raise ConversionError(f"{path}: tensor {name} also appears in another shard")
                self._file_of[name] = path

    def _files_from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConversionError(
                f"{index}: unreadable shard index ({exc!r}); re-download it"
            ) from None
        files = sorted({self.model_dir / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConversionError(f"{index}: shard(s) missing on disk: {_name_list(absent)}")
        return files

    def _open(self, path: Path, framework: str = "np") -> Any:
        handles = self._handles if framework == "np" else self._torch_handles
        if path not in handles:
            try:
                handles[path] = safe_open(str(path), framework=framework)
            except Exception as exc:  # safetensors raises its own error types
                raise ConversionError(f"{path}: not a readable safetensors file ({exc})") from None
        return handles[path]

    # ---- plan-time bookkeeping (no data read) ----

    def rename_prefix(self, disk_prefix: str, prefix: str) -> None:
        """Know every tensor stored as `disk_prefix + rest` as `prefix + rest` (the text model
        inside a multimodal checkpoint, `model.language_model.` -> `model.`)."""
        for disk in [n for n in self._file_of if n.startswith(disk_prefix)]:
            name = prefix + disk[len(disk_prefix) :]
            if name in self._file_of:
                raise ConversionError(f"{self.model_dir}: tensors {disk} and {name} both exist")
            self._file_of[name] = self._file_of.pop(disk)
            self._disk_name[name] = self._disk_name.pop(disk, disk)

    def skip_prefix(self, prefix: str) -> None:
        """Claim every tensor under `prefix`: parts of the checkpoint the conversion leaves out
        (a vision tower, a multi-token-prediction head)."""
        self.claimed.update(n for n in self._file_of if n.startswith(prefix))

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> set[str]:
        return set(self._file_of)

    def _slice(self, name: str, framework: str = "np") -> Any:
        return self._open(self._file_of[name], framework).get_slice(self._disk_name.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._slice(name).get_shape())

    def claim(self, name: str, shape: tuple[int, ...] | None = None) -> str:
        """Mark `name` as used; record it as missing if absent; check its shape when given."""
        self.claimed.add(name)
        if name not in self._file_of:
            self.missing.append(name)
        elif shape is not None and self.shape(name) != tuple(shape):
            raise ConversionError(
                f"tensor {name} has shape {list(self.shape(name))} but config.json implies "
                f"{list(shape)}; the checkpoint and its config do not match"
            )
        return name

    def claim_first(self, candidates: Iterable[str], shape: tuple[int, ...] | None = None) -> str:
        """Claim the first candidate name present (checkpoints name the same tensor differently)."""
        candidates = list(candidates)
        for name in candidates:
            if name in self._file_of:
                return self.claim(name, shape)
        return self.claim(candidates[0], shape)

    def claim_if_present(self, name: str) -> bool:
        if name in self._file_of:
            self.claimed.add(name)
            return True
        return False

    def check_complete(self) -> None:
        """Refuse the checkpoint if a needed tensor is absent or a present one was not mapped."""
        if self.missing:
            raise ConversionError(
                f"{self.model_dir}: missing tensors: {_name_list(self.missing)}; "
                "the checkpoint is incomplete or does not match config.json"
            )
        leftover = {
            n for n in self._file_of if n not in self.claimed and not n.endswith(_IGNORED_SUFFIXES)
        }
        if leftover:
            raise ConversionError(
                f"{self.model_dir}: unprocessed tensors: {_name_list(leftover)}; this checkpoint "
                "has weights the converter does not map (unsupported variant of the architecture)"
            )

    # ---- write-time reads ----

    def load(self, name: str) -> np.ndarray:
        """The whole tensor as float32 numpy (bf16/f16 widen exactly)."""
        return self._read(name, lambda s: s[:])

    def load_index(self, name: str, index: int) -> np.ndarray:
        """`tensor[index]` (one expert of a fused 3-D tensor) as float32; reads only that slice."""
        return self._read(name, lambda s: s[index])

    def load_bytes_index(self, name: str, index: int) -> np.ndarray:
        """`tensor[index]` of a uint8 tensor (packed quantized data, e.g. MXFP4 blocks), as is."""
        path = self._file_of[name]
        dtype = self._slice(name).get_dtype()
        if dtype != "U8":
            raise ConversionError(f"{path}: tensor {name} has dtype {dtype}; expected U8 (bytes)")
        return np.asarray(self._slice(name)[index], dtype=np.uint8)

    def dtype(self, name: str) -> str:
        """The safetensors dtype of a tensor ("F32", "BF16", "U8", ...)."""
        return self._slice(name).get_dtype()

    def _read(self, name: str, take: Any) -> np.ndarray:
        path = self._file_of[name]
        dtype = self._slice(name).get_dtype()
        if dtype not in ("F32", "F16", "BF16", "F64"):
            raise ConversionError(f"{path}: tensor {name} has dtype {dtype}; expected a float type")
        if dtype != "BF16":
            return np.asarray(take(self._slice(name)), dtype=np.float32)
        import torch  # imported lazily: only bf16 checkpoints need it

        return take(self._slice(name, "pt")).to(torch.float32).numpy()
