"""Launch configs of the decode kernels picked on one GPU, overriding the built-in defaults.

A tuning file (written by `bench/gpu_kernels.py --write path.json`, which times each candidate
in CUDA graphs on that GPU) holds, all optional:
    {"q8_gemv": {"NxK": [BLOCK_N, BLOCK_K, num_warps], ...},
     "attention": {"block_s": 32, "programs": 512, "num_warps": 1},
     "router_block_e": 2, "router_warps": 1, "norm_warps": 4, "rope_warps": 4,
     "q8_gemm": {"max_tokens": M}}
("q8_gemm": prompt lengths above M take dequantize + cuBLAS instead of kernels.q8_linear.q8_gemm;
written by `bench/gpu_prefill.py --write path.json` where it measured cuBLAS faster.)
The GPU executor reads the file it is given (`load`) and installs it for the process
(`set_overrides`); the launchers read it through `lookup`. Without one they use their built-in
tables (the values measured best on an H100).
"""

from __future__ import annotations

import json
from pathlib import Path

_OVERRIDES: dict = {}  # the installed tuning: section -> value


def load(path: str | Path) -> dict:
    """The tuning file's sections; ValueError, saying which file and why, when it cannot be read
    or is not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"kernel tuning file {path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"kernel tuning file {path}: expected a JSON object of sections")
    return data


def set_overrides(sections: dict | None) -> None:
    """Install `sections` (as `load` returns them; None or {}: the built-in defaults) for every
    later launch in this process."""
    global _OVERRIDES
    if sections is not None and not isinstance(sections, dict):
        raise TypeError(f"tuning overrides must be a dict of sections, got {type(sections)}")
    _OVERRIDES = dict(sections or {})


def lookup(section: str, key: str | None = None):
    """The override for `section` (and `key` inside it), or None."""
    value = _OVERRIDES.get(section)
    if key is not None and isinstance(value, dict):
        value = value.get(key)
    return value
