"""The bookkeeping of the GPU expert cache: which (layer, expert) each slot holds, what hit.

Slots are model-wide: every routed expert of a model has the same size and format, so any slot
can hold any layer's expert, and the replacement policy (offload/policy.py) weighs all layers
against each other. This class moves no bytes: the staging side copies an admitted expert into
its slot, and the expert kernels read the slots through Residency.expert_map(layer).

Per MoE layer of a step: `lookup(layer, experts)` counts hits and misses and returns the misses;
for each miss the caller either computes the expert elsewhere (the CPU) or `admit`s it (a slot is
freed by the policy, never one the same layer is using now: those are `protect`ed). Keys in
`held` are never evicted either, whatever their layer: the experts a pass is about to read
(staged ahead by a prefetch or a lookahead, or in use by a layer whose kernels are queued).

A prefill's sweep (`admit(..., sweep=True)`): a pass of many tokens uses nearly every expert of
every layer, layer after layer, and the next pass does the same, so each expert's next use is
its layer's turn in the next sweep. Recency (LRU, and LFRU among keys used equally often) then
evicts exactly the experts the sweep reaches next: with 60% of gpt-oss-20b's 768 experts in
slots, a 512-token prefill after another one hit 0 of them. A sweep instead evicts by that
next use, farthest first (Belady's choice for a cyclic order): the experts of the layer just
before this one, then the one before that, back round to the layers after this one; within a
layer, the policy's coldest. A repeated prefill then hits what stays resident (all but the
slots the misses cycle through).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pyruntime.experts.store import Residency
from pyruntime.offload.policy import ReplacementPolicy


@dataclass
class CacheStats:
    hits: int = 0  # (token-layer, expert) routings served by a slot
    misses: int = 0
    admissions: int = 0  # experts copied into a slot
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache:
    def __init__(
        self, n_layer: int, n_expert: int, n_slots: int, policy: ReplacementPolicy
    ) -> None:
        if n_slots < 0:
            raise ValueError(f"n_slots must be >= 0, got {n_slots}")
        self.residency = Residency(n_layer, n_expert, n_slots)
        self.policy = policy
        self.n_slots = n_slots
        self.step = 0  # advanced once per lookup (one routed token-layer)
        self.stats = CacheStats()
        self._free = list(range(n_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.held: set[tuple[int, int]] = set()  # (layer, expert) keys never evicted

    def lookup(self, layer: int, experts: Iterable[int]) -> list[int]:
        """The experts of `layer` not in a slot (in order); hits are counted and touched."""
        self.step += 1
        misses = []
        for e in experts:
            if self.residency.slot(layer, e) >= 0:
                self.stats.hits += 1
                self.policy.touch((layer, e), self.step)
            else:
                self.stats.misses += 1
                misses.append(e)
        return misses

    def admit(self, layer: int, expert: int, protect: Sequence[int] = (),
              sweep: bool = False) -> int:  # fmt: skip
        """A slot for (layer, expert), freeing one when none is free; `protect`: experts of the
        same layer in use now, never evicted; sweep: a prefill's admission, whose victim is the
        expert used again last in a layer-by-layer sweep (module doc). Returns the slot, or -1
        with no slot to give."""
        slot = self.residency.slot(layer, expert)
        if slot >= 0:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            exclude = self.held.union((layer, e) for e in protect) if protect else self.held
            if sweep:
                victim = self._sweep_victim(layer, exclude)
            else:
                victim = self.policy.victim(exclude=exclude)
            if victim is None:
                return -1
            slot = self.residency.slot(*victim)
            self.residency.evict(*victim)
            self.policy.forget(victim)
            self.stats.evictions += 1
        self.residency.place(layer, expert, slot)
        self.policy.touch((layer, expert), self.step)
        self.stats.admissions += 1
        return slot

    def _sweep_victim(self, layer: int, exclude) -> tuple[int, int] | None:
        """The resident key a sweep uses again last, not in `exclude`: the layers before
        `layer`, nearest first, then round from the last layer down to `layer` itself; within
        a layer, the policy's coldest."""
        n_layer = len(self.residency.slots)
        for d in range(1, n_layer + 1):
            j = (layer - d) % n_layer
            keys = [(j, e) for e in np.flatnonzero(self.residency.slots[j] >= 0).tolist()
                    if (j, e) not in exclude]  # fmt: skip
            if keys:
                return self.policy.coldest(keys)
        return None

    def drop(self, layer: int, expert: int) -> None:
        """(layer, expert) leaves its slot, which becomes free (a copy that never happened)."""
        slot = self.residency.slot(layer, expert)
        if slot >= 0:
            self.residency.evict(layer, expert)
            self.policy.forget((layer, expert))
            self._free.append(slot)


def replay_hit_rate(
    routings: Iterable[tuple[int, Sequence[int]]],
    n_layer: int,
    n_expert: int,
    n_slots: int,
    policy: ReplacementPolicy,
) -> CacheStats:
    """Replay (layer, experts of one token) routings through a cache that admits every miss
    (demand caching): the hit rate a policy reaches on that routing at that size."""
    cache = ExpertCache(n_layer, n_expert, n_slots, policy)
    for layer, experts in routings:
        for e in cache.lookup(layer, experts):
            cache.admit(layer, e, protect=experts)
    return cache.stats
