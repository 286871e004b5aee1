"""Launch configs of the decode kernels picked on a GPU, overriding the built-in defaults.

`PYRUNTIME_DECODE_TUNING=path.json` (written by `bench/gpu_kernels.py --write path.json`, which
times each candidate in CUDA graphs on that GPU) holds, all optional:
    {"q8_gemv": {"NxK": [BLOCK_N, BLOCK_K, num_warps], ...},
     "q8_gemv_norm": {"NxK": [...]},            # add_norm_q8_gemv
     "attention": {"block_s": 32, "programs": 512},
     "router_block_e": 2}
Without it the kernels use their built-in tables (the values measured best on an H100).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path


@functools.cache
def overrides() -> dict:
    """The tuning file's contents ({} without PYRUNTIME_DECODE_TUNING); ValueError, saying
    which file and why, when it cannot be read or is not a JSON object."""
    path = os.environ.get("PYRUNTIME_DECODE_TUNING", "")
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"PYRUNTIME_DECODE_TUNING={path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"PYRUNTIME_DECODE_TUNING={path}: expected a JSON object of sections")
    return data


def lookup(section: str, key: str | None = None):
    """The override for `section` (and `key` inside it), or None."""
    value = overrides().get(section)
    if key is not None and isinstance(value, dict):
        value = value.get(key)
    return value
