"""Routed experts, at home where the GGUF mmap puts them, and where else they are resident.

The layer tensor `blk.N.ffn_gud_exps.weight` is [n_expert, n_ff, 3, n_embd] (docs/gguf-layout.md):
expert e is one contiguous block; neuron j of it owns three consecutive rows (gate, up, down^T).
Nothing is read until an expert is computed, so experts stay on disk / in the page cache.

- ExpertStore: one layer's experts (the tensor, its format and shape).
- ExpertHandle: one (layer, expert): its bytes on the host, the unit an expert cache stages.
- Residency: which (layer, expert) pairs also sit in a device's expert slots, and the expert map
  (global expert id -> slot, -1 = not there) the expert kernels of that device take.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import TensorView
from pyruntime.gguf.quant import SUPPORTED, dequantize, row_bytes


@dataclass(frozen=True)
class ExpertBias:
    """Biases of a layer's routed experts (gpt-oss), float32, indexed by expert id."""

    gate_up: torch.Tensor  # [n_expert, n_ff, 2]: neuron j's gate bias, then its up bias
    down: torch.Tensor  # [n_expert, n_embd]: added to the expert's output (before its weight)


@dataclass
class ExpertStore:
    name: str
    qtype: GGMLQuantizationType
    n_expert: int
    n_ff: int  # neurons per expert
    n_embd: int
    raw: np.ndarray  # the mmap view, [n_expert, n_ff, 3, n_embd] (float) or [..., 3, row_bytes]
    layer: int = -1  # the block it belongs to (-1: a store built outside a model)
    bias: ExpertBias | None = None
    swiglu: tuple[float, float] = (1.702, 7.0)  # (alpha, limit) of activation swiglu_oai

    @classmethod
    def from_tensor(
        cls,
        t: TensorView,
        n_expert: int,
        n_ff: int,
        n_embd: int,
        layer: int = -1,
        bias: ExpertBias | None = None,
        swiglu: tuple[float, float] = (1.702, 7.0),
    ) -> ExpertStore:
        if t.shape != (n_expert, n_ff, 3, n_embd):
            raise ModelFileError(
                f"tensor '{t.name}' has shape {list(t.shape)}, expected "
                f"[{n_expert}, {n_ff}, 3, {n_embd}] ([n_expert, n_ff_exp, 3, n_embd])"
            )
        if t.qtype not in SUPPORTED:
            raise ModelFileError(f"tensor '{t.name}': type {t.qtype.name} is not supported")
        return cls(t.name, t.qtype, n_expert, n_ff, n_embd, t.data, layer, bias, swiglu)

    @property
    def bias_pair(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [n_expert, n_ff, 2], down [n_expert, n_embd]) biases, or None."""
        return None if self.bias is None else (self.bias.gate_up, self.bias.down)

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

    def handle(self, e: int) -> ExpertHandle:
        """Expert e of this layer as a handle on its host bytes (no copy)."""
        if not 0 <= e < self.n_expert:
            raise IndexError(f"expert {e} of a layer with {self.n_expert}")
        return ExpertHandle(self.layer, e, self.raw[e].reshape(-1).view(np.uint8))


@dataclass(frozen=True)
class ExpertHandle:
    """One routed expert of one layer, at home in host memory."""

    layer: int
    expert: int
    data: np.ndarray  # uint8 [expert_bytes]: the expert's block in the mmap, read in place

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class Residency:
    """Which (layer, expert) pairs are also resident in one device's expert slots.

    slots[layer] is int32 [n_expert]: the slot holding expert e of that layer, or -1 when it is
    only at home (host memory). `expert_map(layer)` is that array, ready for expert kernels that
    take vLLM-style maps (the C core's and the Triton ones): they compute only mapped experts.
    """

    def __init__(self, n_layer: int, n_expert: int, n_slots: int) -> None:
        self.n_slots = n_slots
        self.slots = [np.full(n_expert, -1, dtype=np.int32) for _ in range(n_layer)]
        self._holder: dict[int, tuple[int, int]] = {}  # slot -> (layer, expert)

    def place(self, layer: int, expert: int, slot: int) -> None:
        """Record that `slot` now holds (layer, expert), replacing whatever it held."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} of {self.n_slots}")
        old = self._holder.get(slot)
        if old is not None:
            self.slots[old[0]][old[1]] = -1
        if self.slots[layer][expert] >= 0:
            del self._holder[int(self.slots[layer][expert])]
        self.slots[layer][expert] = slot
        self._holder[slot] = (layer, expert)

    def evict(self, layer: int, expert: int) -> None:
        slot = int(self.slots[layer][expert])
        if slot >= 0:
            del self._holder[slot]
            self.slots[layer][expert] = -1

    def slot(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert), or -1."""
        return int(self.slots[layer][expert])

    def holder(self, slot: int) -> tuple[int, int] | None:
        """(layer, expert) in `slot`, or None when it is free."""
        return self._holder.get(slot)

    def expert_map(self, layer: int) -> np.ndarray:
        """int32 [n_expert]: global expert id -> slot, -1 = not resident (a copy)."""
        return self.slots[layer].copy()
