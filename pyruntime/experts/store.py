"""Routed experts of one MoE layer, left where the GGUF mmap puts them.

The layer tensor `blk.N.ffn_gud_exps.weight` is [n_expert, n_ff, 3, n_embd] (docs/gguf-layout.md):
expert e is one contiguous block; neuron j of it owns three consecutive rows (gate, up, down^T).
Nothing is read until an expert is computed, so experts stay on disk / in the page cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import TensorView
from pyruntime.gguf.quant import SUPPORTED, dequantize, row_bytes


@dataclass
class ExpertStore:
    name: str
    qtype: GGMLQuantizationType
    n_expert: int
    n_ff: int  # neurons per expert
    n_embd: int
    raw: np.ndarray  # the mmap view, [n_expert, n_ff, 3, n_embd] (float) or [..., 3, row_bytes]

    @classmethod
    def from_tensor(cls, t: TensorView, n_expert: int, n_ff: int, n_embd: int) -> ExpertStore:
        if t.shape != (n_expert, n_ff, 3, n_embd):
            raise ModelFileError(
                f"tensor '{t.name}' has shape {list(t.shape)}, expected "
                f"[{n_expert}, {n_ff}, 3, {n_embd}] ([n_expert, n_ff_exp, 3, n_embd])"
            )
        if t.qtype not in SUPPORTED:
            raise ModelFileError(f"tensor '{t.name}': type {t.qtype.name} is not supported")
        return cls(t.name, t.qtype, n_expert, n_ff, n_embd, t.data)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.qtype, self.n_embd)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's block (gate + up + down of every neuron)."""
        return self.n_ff * 3 * self.row_bytes

    def raw_bytes(self) -> np.ndarray:
        """The whole layer tensor as a flat uint8 view (no copy)."""
        return self.raw.reshape(-1).view(np.uint8)

    def expert_weights(self, e: int) -> torch.Tensor:
        """Dequantized expert e: float32 [n_ff, 3, n_embd] (gate row, up row, down column)."""
        return dequantize(self.raw[e], self.qtype, (self.n_ff, 3, self.n_embd))
