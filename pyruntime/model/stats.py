"""Counts of routed-expert work, to report the achieved neuron sparsity, for prefill and decode
apart."""

from __future__ import annotations

import torch

# What an executor's forward pass is: several tokens at once (a prompt, a draft being verified)
# or one (a decode step). They run different kernels (the GPU's prefill ran dense while decode
# skipped 85% of the neurons), so their sparsity is reported apart; totals sum both.
PHASES = ("prefill", "decode")


class ExpertStats:
    """Counts of routed-expert work, to report achieved neuron sparsity.

    pairs: (token, expert) computations; neurons: pairs * n_ff; active: neurons whose up/down
    rows were used. An executor counts on the host (`add`), or, where the counts come out of
    device kernels, on the device without a sync (`add_pairs` for the host-known part,
    `add_device` for tensors of counts; a captured CUDA graph adds to the device accumulator on
    every replay). Reading pairs / neurons / active / sparsity sums both (one sync).

    Every count goes to the current phase (PHASES), which an executor sets at the start of each
    forward pass (`begin`); pairs / neurons / active / sparsity are totals over both phases,
    `phase_sparsity` one phase's. A CUDA graph adds to the row of the phase it was captured in
    (decode steps).
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        """device: where the device accumulator lives (allocated now, so that a CUDA graph
        captured later adds into a fixed address); None: allocated by the first add_device."""
        self._phase = PHASES.index("decode")
        self._host = [[0, 0, 0] for _ in PHASES]  # per phase: pairs, neurons, active
        self._device: torch.Tensor | None = None  # int64 [len(PHASES), 3], rows as _host
        self._pending: list[tuple[torch.Tensor | None, torch.Tensor | None, int, int]] = []
        if device is not None:
            self._device = torch.zeros(len(PHASES), 3, dtype=torch.int64, device=device)

    @property
    def phase(self) -> str:
        return PHASES[self._phase]

    def begin(self, phase: str) -> None:
        """A forward pass starts: its counts go to `phase`, 'prefill' (several tokens) or
        'decode' (one)."""
        self._phase = PHASES.index(phase)

    def add(self, n_pairs: int, n_active: int, n_ff: int) -> None:
        host = self._host[self._phase]
        host[0] += n_pairs
        host[1] += n_pairs * n_ff
        host[2] += n_active

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
        self._pending.append((active, slots, n_ff, self._phase))

    def flush(self) -> None:
        """Add the pending device counts to the accumulator: three launches (cat, sum, add)
        for the active counts of a step, a few more when pairs were counted on the device.
        Summing each layer's counts on its own took two launches per layer (16 layers: ~50 us
        of a ~1 ms decode step)."""
        if not self._pending:
            return
        if self._device is None:
            t = next(a if a is not None else s for a, s, _, _ in self._pending)
            self._device = torch.zeros(len(PHASES), 3, dtype=torch.int64, device=t.device)
        for ph in sorted({ph for _, _, _, ph in self._pending}):
            pending = [(a, s, n) for a, s, n, p in self._pending if p == ph]
            self._flush_phase(self._device[ph], pending)
        self._pending.clear()

    @staticmethod
    def _flush_phase(acc: torch.Tensor, pending: list) -> None:
        """Adds one phase's pending device counts into its accumulator row acc [3]."""
        active = [a.reshape(-1) for a, _, _ in pending if a is not None]
        if active:
            acc[2:].add_(torch.cat(active).sum(dtype=torch.int64))
        for n_ff in {n for _, s, n in pending if s is not None}:
            mapped = [(s.reshape(-1), a is None) for a, s, n in pending
                      if s is not None and n == n_ff]  # fmt: skip
            pairs = (torch.cat([s for s, _ in mapped]) >= 0).sum()
            dense = [s for s, is_dense in mapped if is_dense]
            dense_pairs = (torch.cat(dense) >= 0).sum() if dense else torch.zeros_like(pairs)
            acc.add_(torch.stack([pairs, pairs * n_ff, dense_pairs * n_ff]))

    def _total(self, i: int, phase: int | None = None) -> int:
        self.flush()
        rows = range(len(PHASES)) if phase is None else (phase,)
        host = sum(self._host[r][i] for r in rows)
        if self._device is None:
            return host
        return host + int(sum(self._device[r, i] for r in rows))

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

    def phase_sparsity(self, phase: str) -> float | None:
        """Fraction of the neurons skipped in one phase (PHASES); None when it ran none."""
        i = PHASES.index(phase)
        neurons = self._total(1, i)
        return None if neurons == 0 else 1.0 - self._total(2, i) / neurons

    def device_snapshot(self) -> torch.Tensor | None:
        """A copy of the device accumulator (to undo a warm-up run: `device_restore`)."""
        return None if self._device is None else self._device.clone()

    def device_restore(self, snapshot: torch.Tensor | None) -> None:
        if snapshot is not None and self._device is not None:
            self._device.copy_(snapshot)

    def reset(self) -> None:
        self._host = [[0, 0, 0] for _ in PHASES]
        self._pending.clear()
        if self._device is not None:
            self._device.zero_()
