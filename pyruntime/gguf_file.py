"""Open a pyruntime GGUF file: validated metadata and zero-copy tensor views.

The file is mapped with `np.memmap` (through `gguf.GGUFReader`), so opening a multi-GB model is
instant and costs no resident memory until a tensor's pages are touched. Tensor views returned
here point into that mapping; nothing is copied until a caller converts a view.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor

from pyruntime.errors import ModelFileError

LAYOUT_VERSION = 1
_MISSING = object()


@dataclass(frozen=True)
class TensorView:
    """One tensor of the file, as stored.

    `shape` is row-major (outermost first, numpy order), i.e. GGUF's `ne` reversed.
    `data` is the raw memmap view: typed (float32/float16/...) with `shape` for float formats;
    uint8 of shape [*shape[:-1], row_bytes] for block-quantized formats (and BF16, which numpy
    lacks: it is exposed as uint8 pairs too by gguf).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    n_elements: int
    n_bytes: int


class GGUFFile:
    """A validated, memory-mapped GGUF file written by our converter."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self.file_size = path.stat().st_size
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            self.metadata[name] = _field_value(field)
        self.tensors: dict[str, TensorView] = {t.name: _tensor_view(t) for t in reader.tensors}
        self.arch: str = self.get("general.architecture")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value as a Python object; ModelFileError if missing and no default."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ModelFileError(f"{self.path}: metadata key '{key}' is missing")
        return default

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        return self.get(f"{self.arch}.{suffix}", default)

    def tensor(self, name: str) -> TensorView:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(
                f"{self.path}: tensor '{name}' is missing (was the file written by "
                "convert_hf_to_gguf.py of this version?)"
            ) from None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate `path`; every failure is a one-line ModelFileError."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(
            f"{path}: is a directory; convert a Hugging Face folder first with "
            f"`python convert_hf_to_gguf.py {path}`"
        )
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: corrupt or truncated GGUF file ({exc})") from None
    _check_tensor_extents(path, reader)
    f = GGUFFile(path, reader)
    version = f.get("pyruntime.layout_version", None)
    if version != LAYOUT_VERSION:
        raise ModelFileError(
            f"{path}: GGUF layout version {version} is not supported (this pyruntime reads "
            f"version {LAYOUT_VERSION}); convert the model again with convert_hf_to_gguf.py"
        )
    return f


def _check_tensor_extents(path: Path, reader: GGUFReader) -> None:
    """A truncated file can still parse its header: check every tensor lies inside the file."""
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ModelFileError(
                f"{path}: truncated GGUF file: tensor '{t.name}' ends at byte {end} "
                f"but the file has {size} bytes"
            )


def _field_value(field: Any) -> Any:
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        return field.contents()
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _tensor_view(t: ReaderTensor) -> TensorView:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return TensorView(
        name=t.name,
        qtype=GGMLQuantizationType(int(t.tensor_type)),
        shape=shape,
        data=t.data,
        n_elements=int(t.n_elements),
        n_bytes=int(t.n_bytes),
    )
