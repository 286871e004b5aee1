"""Which cached expert to evict: replacement policies of the GPU expert cache.

A key is one (layer, expert). A policy tracks exactly the keys resident in the cache: the cache
calls `touch(key, step)` whenever a key is used (a hit, or an admission), `forget(key)` when it
leaves, and `victim(exclude)` for the key to evict, never one in `exclude` (the experts the
current layer is using); `coldest(keys)` is the one of a few resident keys it would evict first
(the cache's choice within one layer during a prefill's sweep, pyruntime.offload.cache). `step`
is a counter the cache advances once per routed token-layer, so "recent" is measured in routing
decisions, not wall time. Picking a victim costs O(log n) (LFRU) or O(1 + |exclude|) (LRU), so
a cache of thousands of slots stays cheap per token.

- LRU: the least recently used key goes. MoE routing has strong temporal locality (consecutive
  tokens reuse experts), which LRU exploits, but one burst of rarely used experts flushes the
  experts every token needs.
- LFRU (frequency-weighted LRU, as vLLM's expert offload uses): each key keeps a use count that
  decays exponentially with the steps since its last use (half-life `half_life` steps); the key
  with the smallest decayed count goes (ties: the least recent). Counts outlive evictions (one
  float per (layer, expert) of the model), so a newly admitted expert ranks by its history: a
  one-off expert goes first, a hot expert that a burst pushed out comes back with its count.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence
from typing import Protocol

Key = Hashable


class ReplacementPolicy(Protocol):
    name: str

    def touch(self, key: Key, step: int) -> None: ...

    def forget(self, key: Key) -> None: ...

    def victim(self, exclude: Container[Key] = ()) -> Key | None: ...

    def coldest(self, keys: Sequence[Key]) -> Key: ...


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, int] = OrderedDict()  # least recent first -> its serial
        self._serial = 0

    def touch(self, key: Key, step: int) -> None:
        self._serial += 1
        self._order[key] = self._serial
        self._order.move_to_end(key)

    def forget(self, key: Key) -> None:
        self._order.pop(key, None)

    def coldest(self, keys: Sequence[Key]) -> Key:
        """The least recently used of `keys` (resident ones)."""
        return min(keys, key=self._order.__getitem__)

    def victim(self, exclude: Container[Key] = ()) -> Key | None:
        """The least recently used key not in `exclude` (None when there is none)."""
        return next((k for k in self._order if k not in exclude), None)


class LFRU:
    name = "lfru"

    def __init__(self, half_life: float = 256.0) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self._rate = math.log(2.0) / half_life  # decay per step
        self._count: dict[Key, float] = {}  # decayed use count as of the key's last use
        self._last: dict[Key, int] = {}
        # The decayed count at step s is count * exp(-rate (s - last)); its order between keys
        # does not depend on s, so each key ranks by log(count) + rate * last, fixed until its
        # next touch: a heap with stale entries skipped.
        self._heap: list[tuple[float, int, int, Key]] = []
        self._serial = 0  # tie-breaker that never compares keys
        self._entry: dict[Key, int] = {}  # key -> serial of its live heap entry

    def touch(self, key: Key, step: int) -> None:
        if key in self._count:
            count = self._count[key] * math.exp(-self._rate * (step - self._last[key])) + 1.0
        else:
            count = 1.0
        self._count[key], self._last[key] = count, step
        self._serial += 1
        self._entry[key] = self._serial
        heapq.heappush(self._heap, (math.log(count) + self._rate * step, step, self._serial, key))

    def coldest(self, keys: Sequence[Key]) -> Key:
        """The one of `keys` (resident ones) with the smallest decayed use count (ties: the
        least recent): victim's order, over a few keys."""
        return min(keys, key=lambda k: (math.log(self._count[k]) + self._rate * self._last[k],
                                        self._last[k]))  # fmt: skip

    def forget(self, key: Key) -> None:
        """The key left the cache; its use count is kept, so an expert that comes back ranks by
        its whole history (a hot expert evicted by a burst is not a newcomer again)."""
        self._entry.pop(key, None)

    def victim(self, exclude: Container[Key] = ()) -> Key | None:
        """The key with the smallest decayed use count (ties: the least recent) not in
        `exclude` (None when there is none)."""
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[3]
            if self._entry.get(key) != entry[2]:
                continue  # stale: touched again or forgotten since
            skipped.append(entry)
            if key not in exclude:
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._entry) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if self._entry.get(e[3]) == e[2]]
            heapq.heapify(self._heap)
        return found


POLICIES = {"lru": LRU, "lfru": LFRU}


def make_policy(name: str) -> ReplacementPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown cache policy '{name}' (use {', '.join(POLICIES)})") from None
