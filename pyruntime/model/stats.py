"""Counts of routed-expert work, to report the achieved neuron sparsity."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertStats:
    """Counts of routed-expert work, to report achieved neuron sparsity."""

    pairs: int = 0  # (token, expert) computations
    neurons: int = 0  # pairs * n_ff
    active: int = 0  # neurons whose up/down rows were used

    def add(self, n_pairs: int, n_active: int, n_ff: int) -> None:
        self.pairs += n_pairs
        self.neurons += n_pairs * n_ff
        self.active += n_active

    @property
    def sparsity(self) -> float:
        return 0.0 if self.neurons == 0 else 1.0 - self.active / self.neurons

    def reset(self) -> None:
        self.pairs = self.neurons = self.active = 0
