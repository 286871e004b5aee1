"""Reading a Hugging Face config.json with errors a user can act on.

`HParams` wraps the parsed dict: typed getters raise `ConversionError` naming the file and the
field, so an architecture class reads `hp.int("hidden_size")` and never sees a KeyError.
It also knows the two rope config styles (top-level `rope_theta`, or transformers 5's
`rope_parameters: {rope_theta, rope_type}` / older `rope_scaling`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyruntime.errors import ConversionError

# HF `hidden_act` -> `pyruntime.expert_activation` (docs/gguf-layout.md).
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_new": "gelu",
    "gelu": "gelu_exact",
}


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Parse a JSON object file, turning absence or bad JSON into a one-line ConversionError."""
    if not path.is_file():
        raise ConversionError(f"{path}: missing {what}; the model folder must contain it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc}); re-download the file") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class HParams:
    """config.json of one checkpoint, with validating getters."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        self.config = config
        self.path = path

    @classmethod
    def load(cls, model_dir: Path) -> HParams:
        path = model_dir / "config.json"
        return cls(read_json(path, "config.json"), path)

    def _bad(self, key: str, why: str) -> ConversionError:
        return ConversionError(f"{self.path}: field '{key}' {why}; fix config.json")

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """An integer field >= minimum; required unless a default is given."""
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise self._bad(key, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self._bad(key, f"must be >= {minimum}, got {value}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise self._bad(key, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, f"must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, f"must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.config.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise self._bad(key, f"must be a list of integers, got {value!r}")
        return value

    def head_dim(self) -> int:
        """Per-head size: explicit `head_dim`, else hidden_size / num_attention_heads."""
        if self.has("head_dim"):
            return self.int("head_dim")
        hidden, heads = self.int("hidden_size"), self.int("num_attention_heads")
        if hidden % heads:
            raise self._bad("num_attention_heads", f"does not divide hidden_size {hidden}")
        return hidden // heads

    def rope_params(self) -> dict[str, Any]:
        """The rope sub-config (`rope_parameters`, or the older `rope_scaling`), {} when absent."""
        params = self.config.get("rope_parameters") or self.config.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise self._bad("rope_parameters", f"must be an object, got {params!r}")
        return params

    def rope_theta(
        self, rope_types: tuple[str, ...] = ("default",), partial_ok: bool = False
    ) -> float:
        """Rope base frequency from either config style; the rope type must be one of
        `rope_types` (the family's), plain (unscaled) rope by default; a partial rotary factor
        other than 1 only where the family has one (`partial_ok`: see partial_rotary_factor)."""
        params = self.rope_params()
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type not in rope_types:
            raise ConversionError(
                f"{self.path}: rope type '{rope_type}' is not supported for this architecture "
                f"(supported: {', '.join(rope_types)}); convert a checkpoint without rope scaling"
            )
        partial = params.get("partial_rotary_factor", self.config.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0) and not partial_ok:
            raise self._bad("partial_rotary_factor", f"must be 1 (full rotary), got {partial!r}")
        theta = params.get("rope_theta", self.config.get("rope_theta"))
        if theta is None:
            raise self._bad("rope_theta", "is missing (neither top-level nor in rope_parameters)")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise self._bad("rope_theta", f"must be a positive number, got {theta!r}")
        return float(theta)

    def partial_rotary_factor(self) -> float:
        """The share of each head's dims that rope rotates (rope_parameters or top level), 1 when
        absent; in (0, 1]."""
        value = self.rope_params().get(
            "partial_rotary_factor", self.config.get("partial_rotary_factor", 1.0)
        )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise self._bad("partial_rotary_factor", f"must be a number in (0, 1], got {value!r}")
        return float(value)

    def rope_number(self, key: str, default: float | None = None) -> float:
        """A positive number of the rope sub-config (`rope_parameters.{key}`)."""
        value = self.rope_params().get(key)
        if value is None:
            if default is None:
                raise self._bad(f"rope_parameters.{key}", "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self._bad(f"rope_parameters.{key}", f"must be a positive number, got {value!r}")
        return float(value)

    def activation(self) -> str:
        act = self.config.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise self._bad(
                "hidden_act", f"'{act}' is not supported (use one of {sorted(_ACTIVATIONS)})"
            )
        return _ACTIVATIONS[act]
