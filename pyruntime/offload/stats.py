"""What the hybrid executor did: slot hits, bytes moved, CPU expert time, and where a token's
time went.

Counters are kept on the host at no cost to the device. The time by part (the dense GPU work,
GPU experts, waits for copies) is measured on the device's compute stream with CUDA events
when `PartTimer.enabled` (`--stats`: about 10 event records per MoE layer and token, so it is
off otherwise); on a CPU device, where each op runs when issued, with the host clock. CPU expert
calls and the time between steps (sampling, the decoding strategy) are host times, always kept.
The parts overlap (the CPU computes while the GPU does), so they do not add up to a token's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pyruntime.offload.cache import CacheStats

# dense: a decode step's graph segments (each the previous MoE layer's FFN output, attention
# and route: pyruntime.offload.segments); attention and router: a prefill's, apart
PARTS = ("dense", "attention", "router", "gpu_experts", "copy_wait")


class PartTimer:
    """Seconds per part of the forward passes (module doc)."""

    def __init__(self, cuda: bool, enabled: bool = False) -> None:
        self.cuda = cuda
        self.enabled = enabled or not cuda  # the host clock is free on a CPU device
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._pending: list[tuple[str, object, object]] = []

    def start(self) -> object | None:
        """A start point on the compute stream (None when not timing)."""
        if not self.enabled:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, part: str, start: object | None) -> object | None:
        """Close `part` begun at `start`; returns the end point (the next part's start)."""
        if start is None:
            return None
        end = self.start()
        if self.cuda:
            self._pending.append((part, start, end))
        else:
            self.seconds[part] += end - start
        return end

    def collect(self) -> None:
        """Add the pending CUDA intervals (after the host waited for the compute stream)."""
        for part, start, end in self._pending:
            self.seconds[part] += start.elapsed_time(end) / 1e3
        self._pending.clear()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._pending.clear()


@dataclass
class OffloadStats:
    """Counts of the hybrid's work, accumulated over forward passes."""

    passes: int = 0  # forward calls
    tokens: int = 0  # tokens they processed
    staged: int = 0  # experts copied into slots (misses, prefetches, lookaheads)
    staged_bytes: int = 0
    prefetched: int = 0  # of the staged: by prefetch() and the lookahead
    direct: int = 0  # (layer, expert) pairs the GPU read in place from host memory
    direct_bytes: int = 0
    cpu_experts: int = 0  # (layer, expert) pairs of a pass computed on the CPU
    cpu_bytes: int = 0  # bytes the CPU read for them (sparse: estimated from the kept neurons)
    cpu_seconds: float = 0.0  # wall time of the CPU expert calls
    # the cost model's seconds for the same work (pyruntime.offload.costs; 0 without costs):
    # the CPU's shares, and the staged experts' copies and GPU time
    cpu_model_seconds: float = 0.0
    stage_model_seconds: float = 0.0
    route_wait_seconds: float = 0.0  # the host waiting for a layer's routing
    between_seconds: float = 0.0  # host time between consecutive decode steps (sampling)
    decode_steps: int = 0
    timer_seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self, cache: CacheStats, n_slots: int, resident_share: float) -> dict:
        per_token = 1.0 / self.tokens if self.tokens else 0.0
        parts = {name: s * per_token for name, s in self.timer_seconds.items()}
        parts["cpu_experts"] = self.cpu_seconds * per_token
        parts["route_wait"] = self.route_wait_seconds * per_token
        if self.decode_steps > 1:
            parts["sampling"] = self.between_seconds / (self.decode_steps - 1)
        return {
            "slots": n_slots,
            "resident_share": resident_share,
            "slot_hit_rate": cache.hit_rate,
            "slot_hits": cache.hits,
            "slot_misses": cache.misses,
            "evictions": cache.evictions,
            "staged_experts": self.staged,
            "staged_bytes": self.staged_bytes,
            "prefetched_experts": self.prefetched,
            "direct_experts": self.direct,
            "direct_bytes": self.direct_bytes,
            "cpu_experts": self.cpu_experts,
            "cpu_bytes": self.cpu_bytes,
            "cpu_expert_seconds": self.cpu_seconds,
            "tokens": self.tokens,
            "seconds_per_token": parts,
            "model_seconds_per_token": {"cpu_experts": self.cpu_model_seconds * per_token,
                                        "staging": self.stage_model_seconds * per_token},
        }  # fmt: skip
