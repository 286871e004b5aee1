"""The GPU expert cache's bookkeeping and replacement policies (no GPU involved)."""

from __future__ import annotations

import math
import random

import pytest

from pyruntime.offload.cache import ExpertCache, replay_hit_rate
from pyruntime.offload.policy import LFRU, LRU, make_policy


def test_lru_evicts_the_least_recent_not_excluded():
    p = LRU()
    for step, key in enumerate("abcd"):
        p.touch(key, step)
    p.touch("a", 4)
    assert p.victim() == "b"
    assert p.victim(exclude={"b", "c"}) == "d"
    p.forget("b")
    assert p.victim() == "c"
    assert p.victim(exclude={"a", "c", "d"}) is None


def lfru_reference(history: dict, resident: set, step: int, rate: float, exclude) -> object:
    """Brute force: the resident key with the smallest decayed count over its whole history
    (evictions included), ties by least recent."""

    def decayed(uses):
        return sum(math.exp(-rate * (step - s)) for s in uses)

    keys = [k for k in resident if k not in exclude]
    return min(keys, key=lambda k: (round(decayed(history[k]), 9), max(history[k])))


def test_lfru_matches_a_brute_force_reference():
    rng = random.Random(0)
    p = LFRU(half_life=8.0)
    history: dict[int, list[int]] = {}
    resident: set[int] = set()
    for step in range(1, 400):
        key = rng.choice(range(12)) if rng.random() < 0.7 else rng.choice(range(3))
        p.touch(key, step)
        history.setdefault(key, []).append(step)
        resident.add(key)
        if step % 7 == 0:
            exclude = set(rng.sample(sorted(resident), k=min(2, len(resident))))
            want = lfru_reference(history, resident, step, math.log(2) / 8.0, exclude)
            got = p.victim(exclude)
            assert got == want, step
            if rng.random() < 0.5:  # evict it, as the cache would
                p.forget(got)
                resident.discard(got)


def test_lfru_keeps_a_hot_key_through_a_burst_where_lru_drops_it():
    for policy, survives in ((LFRU(half_life=64.0), True), (LRU(), False)):
        cache = ExpertCache(n_layer=1, n_expert=100, n_slots=4, policy=policy)
        for _ in range(20):  # expert 0 is used by every token
            for e in cache.lookup(0, [0]):
                cache.admit(0, e)
        for burst in range(1, 6):  # five one-off experts, one token each
            for e in cache.lookup(0, [burst]):
                cache.admit(0, e)
        assert (cache.residency.slot(0, 0) >= 0) is survives, policy.name


def test_admit_uses_free_slots_then_evicts_but_never_a_protected_expert():
    cache = ExpertCache(n_layer=2, n_expert=8, n_slots=3, policy=LRU())
    assert cache.lookup(0, [1, 2]) == [1, 2]
    assert [cache.admit(0, e, protect=[1, 2]) for e in (1, 2)] == [0, 1]
    assert cache.lookup(1, [5]) == [5] and cache.admit(1, 5) == 2
    assert cache.lookup(0, [1, 3]) == [3]  # 1 hits
    slot = cache.admit(0, 3, protect=[1, 3])  # full: evicts the LRU key not in use, (0, 2)
    assert slot == 1 and cache.residency.slot(0, 2) == -1 and cache.residency.slot(0, 3) == 1
    assert cache.stats.hits == 1 and cache.stats.misses == 4 and cache.stats.evictions == 1
    tiny = ExpertCache(n_layer=1, n_expert=4, n_slots=1, policy=LRU())
    tiny.lookup(0, [0, 1])
    assert tiny.admit(0, 0, protect=[0, 1]) == 0
    assert tiny.admit(0, 1, protect=[0, 1]) == -1  # the only slot is in use by this layer
    assert ExpertCache(1, 4, 0, LRU()).admit(0, 0) == -1


@pytest.mark.parametrize("name", ["lru", "lfru"])
def test_replay_hit_rate_bounds(name):
    rng = random.Random(1)
    routing = [(layer, rng.sample(range(16), 4)) for _ in range(300) for layer in range(2)]
    everything = replay_hit_rate(routing, 2, 16, 32, make_policy(name))
    assert everything.evictions == 0 and everything.misses == 32  # only the first use misses
    half = replay_hit_rate(routing, 2, 16, 16, make_policy(name)).hit_rate
    assert 0.3 < half < 0.7  # uniform routing: about the cached fraction
    assert replay_hit_rate(routing, 2, 16, 0, make_policy(name)).hit_rate == 0.0


def test_held_keys_are_never_evicted_whatever_their_layer():
    cache = ExpertCache(n_layer=2, n_expert=8, n_slots=2, policy=LRU())
    assert cache.admit(0, 1) == 0 and cache.admit(1, 2) == 1
    cache.held = {(0, 1)}
    assert cache.admit(1, 3) == 1  # (0, 1) is the least recent, but held: (1, 2) goes
    cache.held = {(0, 1), (1, 3)}
    assert cache.admit(0, 4) == -1  # every slot held
    cache.held = set()
    assert cache.admit(0, 4) == 0


def test_a_dropped_expert_frees_its_slot():
    cache = ExpertCache(n_layer=1, n_expert=8, n_slots=2, policy=LRU())
    assert cache.admit(0, 1) == 0 and cache.admit(0, 2) == 1
    cache.drop(0, 1)
    assert cache.residency.slot(0, 1) == -1 and cache.residency.holder(0) is None
    assert cache.admit(0, 3) == 0 and cache.stats.evictions == 0  # the free slot, no eviction
    cache.drop(0, 5)  # not resident: nothing to do


def sweeps(cache: ExpertCache, n_layer: int, n_expert: int, passes: int, sweep: bool) -> list:
    """Hits of each of `passes` prefills that use every expert of every layer, layer by layer,
    each miss admitted (with the layer's experts protected)."""
    hits = []
    for _ in range(passes):
        before = cache.stats.hits
        for layer in range(n_layer):
            used = list(range(n_expert))
            for e in cache.lookup(layer, used):
                assert cache.admit(layer, e, protect=used, sweep=sweep) >= 0
        hits.append(cache.stats.hits - before)
    return hits


@pytest.mark.parametrize("name", ["lru", "lfru"])
def test_a_prefills_sweep_keeps_what_the_next_prefill_hits(name):
    """Prefills that use every expert, layer after layer: recency evicts exactly the experts the
    next sweep needs first (no hit at 60% of the experts in slots); the sweep order keeps all
    but the slots the misses cycle through, and picks within a layer by the policy."""
    n_layer, n_expert, n_slots = 6, 8, 29  # 60% of 48 experts
    plain = ExpertCache(n_layer, n_expert, n_slots, make_policy(name))
    assert sweeps(plain, n_layer, n_expert, 3, sweep=False)[1:] == [0, 0]
    cache = ExpertCache(n_layer, n_expert, n_slots, make_policy(name))
    hits = sweeps(cache, n_layer, n_expert, 3, sweep=True)
    assert all(h >= n_slots - n_expert for h in hits[1:]), hits


def test_a_sweeps_victim_is_in_the_layer_swept_last():
    """At layer i the victim comes from layer i - 1 (its next use is a whole sweep away), then
    i - 2, ..., round from the last layer; the policy's coldest there; never held or protected."""
    cache = ExpertCache(n_layer=3, n_expert=4, n_slots=5, policy=LRU())
    for key in ((0, 0), (0, 1), (1, 0), (2, 0), (2, 1)):
        assert cache.admit(*key) >= 0
    cache.held = {(0, 0)}
    assert cache.admit(1, 1, protect=[0, 1], sweep=True) == 1  # (0, 1): (0, 0) is held
    assert cache.admit(0, 2, protect=[2], sweep=True) == 3  # layer 2's coldest, (2, 0)
    cache.held = set()
    assert cache.admit(2, 3, protect=[3], sweep=True) == 2  # layer 1: (1, 0) before (1, 1)
    assert cache.admit(1, 2, protect=[0, 1, 2], sweep=True) == 0  # layer 0's coldest, (0, 0)
    assert cache.residency.slot(0, 0) == -1 and cache.residency.slot(1, 0) == -1


def test_coldest_is_the_policys_victim_among_a_few_keys():
    rng = random.Random(2)
    for policy in (LRU(), LFRU(half_life=8.0)):
        for step in range(1, 200):
            policy.touch(rng.choice(range(10)), step)
        keys = [3, 5, 7]
        assert policy.coldest(keys) == policy.victim(exclude=set(range(10)) - set(keys))
