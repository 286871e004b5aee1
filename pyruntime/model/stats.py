"""Counts of routed-expert work, to report the achieved neuron sparsity."""

from __future__ import annotations

import torch


class ExpertStats:
    """Counts of routed-expert work, to report achieved neuron sparsity.

    pairs: (token, expert) computations; neurons: pairs * n_ff; active: neurons whose up/down
    rows were used. An executor counts on the host (`add`), or, where the counts come out of
    device kernels, on the device without a sync (`add_pairs` for the host-known part,
    `add_device` for tensors of counts; a captured CUDA graph adds to the device accumulator on
    every replay). Reading pairs / neurons / active / sparsity sums both (one sync).
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        """device: where the device accumulator lives (allocated now, so that a CUDA graph
        captured later adds into a fixed address); None: allocated by the first add_device."""
        self._host = [0, 0, 0]  # pairs, neurons, active
        self._device: torch.Tensor | None = None  # int64 [3]: pairs, neurons, active
        self._pending: list[tuple[torch.Tensor | None, torch.Tensor | None, int]] = []
        if device is not None:
            self._device = torch.zeros(3, dtype=torch.int64, device=device)

    def add(self, n_pairs: int, n_active: int, n_ff: int) -> None:
        self._host[0] += n_pairs
        self._host[1] += n_pairs * n_ff
        self._host[2] += n_active

    def add_pairs(self, n_pairs: int, n_ff: int) -> None:
        """Host counts of pairs whose active neurons are counted on the device (add_device)."""
        self.add(n_pairs, 0, n_ff)

    def add_device(
        self, active: torch.Tensor | None, slots: torch.Tensor | None = None, n_ff: int = 0
    ) -> None:
        """Device counts, kept until `flush`: active neurons (an int tensor, summed) and, when
        which pairs were computed is known on the device only, the slot of each pair's expert
        (an expert map applied to the routing: -1 = not computed here; the others count as
        pairs of n_ff neurons, all of them active when `active` is None: a dense layer)."""
        self._pending.append((active, slots, n_ff))

    def flush(self) -> None:
        """Add the pending device counts to the accumulator: three launches (cat, sum, add)
        for the active counts of a step, a few more when pairs were counted on the device.
        Summing each layer's counts on its own took two launches per layer (16 layers: ~50 us
        of a ~1 ms decode step)."""
        if not self._pending:
            return
        if self._device is None:
            t = next(a if a is not None else s for a, s, _ in self._pending)
            self._device = torch.zeros(3, dtype=torch.int64, device=t.device)
        active = [a.reshape(-1) for a, _, _ in self._pending if a is not None]
        if active:
            self._device[2:].add_(torch.cat(active).sum(dtype=torch.int64))
        for n_ff in {n for _, s, n in self._pending if s is not None}:
            mapped = [(s.reshape(-1), a is None) for a, s, n in self._pending
                      if s is not None and n == n_ff]  # fmt: skip
            pairs = (torch.cat([s for s, _ in mapped]) >= 0).sum()
            dense = [s for s, is_dense in mapped if is_dense]
            dense_pairs = (torch.cat(dense) >= 0).sum() if dense else torch.zeros_like(pairs)
            self._device.add_(torch.stack([pairs, pairs * n_ff, dense_pairs * n_ff]))
        self._pending.clear()

    def _total(self, i: int) -> int:
        self.flush()
        return self._host[i] + (0 if self._device is None else int(self._device[i]))

    @property
    def pairs(self) -> int:
        return self._total(0)

    @property
    def neurons(self) -> int:
        return self._total(1)

    @property
    def active(self) -> int:
        return self._total(2)

    @property
    def sparsity(self) -> float:
        neurons = self.neurons
        return 0.0 if neurons == 0 else 1.0 - self.active / neurons

    def device_snapshot(self) -> torch.Tensor | None:
        """A copy of the device accumulator (to undo a warm-up run: `device_restore`)."""
        return None if self._device is None else self._device.clone()

    def device_restore(self, snapshot: torch.Tensor | None) -> None:
        if snapshot is not None and self._device is not None:
            self._device.copy_(snapshot)

    def reset(self) -> None:
        self._host = [0, 0, 0]
        self._pending.clear()
        if self._device is not None:
            self._device.zero_()
