"""The rope scalings a GGUF can name (`{arch}.rope.scaling.*`, docs/gguf-layout.md) as plain data:
the model's configuration holds them without importing torch (pyruntime.model.rope computes the
frequencies from them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Yarn:
    """YaRN scaling (GGUF `{arch}.rope.scaling.*`, docs/gguf-layout.md)."""

    factor: float
    original_context_length: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the correction bounds outward (floor / ceil)
    attn_factor: float | None = None  # None: 0.1 ln(factor) + 1 (factor > 1), else 1


@dataclass(frozen=True)
class Llama3:
    """Llama 3 rope scaling (GGUF `{arch}.rope.scaling.*`, docs/gguf-layout.md)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context_length: int
