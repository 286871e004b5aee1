"""The arguments a C decode step or prefill takes, filled from torch tensors and the KV cache.

`CallArgs` owns one reused argument struct (pyrt_step_args or pyrt_prefill_args) and what its
pointers borrow. Both structs share the KV cache (pyrt_kv_cache), the expert arguments
(pyrt_expert_args: thresholds, k, expert maps) and the routing outputs, each pointer with the
length of what it points at: the C side checks every length and never reads past it. A plain call
sets only what changes (the cache's pointers when its storage moves; k, maps and routing outputs
once after a call that had them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pyruntime.cpu import core as cpu_core
from pyruntime.model.config import ModelConfig
from pyruntime.model.kv_cache import KVCache


def cache_pointers(cache: KVCache) -> tuple:
    """(k pointers, v pointers, capacity, floats per layer) of the cache's current storage, kept
    in the cache's executor_state until the storage moves."""
    pointers = cache.executor_state.get("cpu")
    if pointers is None:
        ffi = cpu_core._ffi
        if cache.device.type != "cpu" or cache.dtype != torch.float32:
            raise cpu_core.CoreError("the C decoder needs a float32 KV cache on the CPU")
        if not all(t.is_contiguous() for t in (*cache.k, *cache.v)):
            raise cpu_core.CoreError("the KV cache storage is not contiguous")
        kp = ffi.new("float *[]", [ffi.cast("float *", t.data_ptr()) for t in cache.k])
        vp = ffi.new("float *[]", [ffi.cast("float *", t.data_ptr()) for t in cache.v])
        floats = min(t.numel() for t in (*cache.k, *cache.v))
        pointers = cache.executor_state["cpu"] = (kp, vp, len(cache.k), cache.capacity, floats)
    return pointers


def out_pointer(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], name: str):
    """(data pointer, elements) of an output tensor the caller allocated ((NULL, 0) for None)."""
    ffi = cpu_core._ffi
    if t is None:
        return ffi.NULL, 0
    if not (
        isinstance(t, torch.Tensor)
        and t.dtype is dtype
        and t.is_cpu
        and tuple(t.shape) == shape
        and t.is_contiguous()
    ):
        raise cpu_core.CoreError(
            f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got "
            f"{cpu_core._describe(t)}"
        )
    ctype = "int32_t *" if dtype is torch.int32 else "float *"
    return ffi.cast(ctype, t.data_ptr()), t.numel()


class CallArgs:
    """One reused pyrt_step_args or pyrt_prefill_args (`self.args`) and what it borrows."""

    def __init__(self, cfg: ModelConfig, ctype: str) -> None:
        self._ffi = cpu_core._ffi
        self.config = cfg
        self.args = self._ffi.new(f"{ctype} *")
        self._bound = None  # the cache pointers args holds
        self._thr_values: list[float] | None = None
        self._thr_array = None
        self._extras = False  # args holds k, maps or routing outputs of an earlier call
        self._keep: list = []  # the maps args borrows

    def _thresholds(self, thr: Sequence[float | None] | None):
        """float * of the per-layer thresholds (NULL: dense), rebuilt when the list changes."""
        if thr is None:
            return self._ffi.NULL
        values = [0.0 if t is None else float(t) for t in thr]
        if self._thr_values != values:
            self._thr_values = values
            self._thr_array = self._ffi.new("float[]", values)
        return self._thr_array

    def _maps(self, expert_maps: Sequence[torch.Tensor | None] | None, keep: list):
        """const int32_t *const * of per-layer expert maps (NULL: every expert here)."""
        if expert_maps is None:
            return self._ffi.NULL
        cfg = self.config
        if len(expert_maps) != cfg.n_layer:
            raise cpu_core.CoreError(
                f"expert_maps has {len(expert_maps)} entries, expected one per layer "
                f"({cfg.n_layer}; None where every expert is computed here)"
            )
        ptrs = []
        for i, m in enumerate(expert_maps):
            if m is None:
                ptrs.append(self._ffi.NULL)
                continue
            m = cpu_core._as_cpu(m, torch.int32, f"expert_maps[{i}]", 1)
            if m.shape != (cfg.n_expert,):
                raise cpu_core.CoreError(
                    f"expert_maps[{i}] has shape {tuple(m.shape)}, expected ({cfg.n_expert},)"
                )
            keep.append(m)
            ptrs.append(self._ffi.cast("const int32_t *", m.data_ptr()))
        array = self._ffi.new("const int32_t *[]", ptrs)
        keep.append(array)
        return array

    def bind(
        self,
        cache: KVCache,
        thresholds: Sequence[float | None] | None,
        k: int | None,
        route_ids: torch.Tensor | None,
        route_logits: torch.Tensor | None,
        expert_maps: Sequence[torch.Tensor | None] | None,
    ) -> None:
        """Sets the cache, the expert arguments and the routing outputs of the next call. What
        the C side borrows is kept alive by the cache (its pointers) and self (thresholds,
        maps)."""
        cfg, a = self.config, self.args
        pointers = cache_pointers(cache)
        if pointers is not self._bound:  # another cache, or its storage moved
            c = a.cache
            c.k, c.v, c.n_layer, c.cap, c.layer_floats = pointers
            self._bound = pointers
        e = a.experts
        e.thresholds = self._thresholds(thresholds)
        e.n_thresholds = 0 if thresholds is None else len(thresholds)
        extras = not (k is None and route_ids is None and route_logits is None)
        if extras or expert_maps is not None or self._extras:  # else they are all unset still
            n_k = cfg.n_expert_used if k is None else k
            if not isinstance(n_k, int) or not 1 <= n_k <= cfg.n_expert:
                raise cpu_core.CoreError(
                    f"k={k!r} experts per token is outside [1, n_expert={cfg.n_expert}]"
                )
            keep: list = []
            e.k = n_k
            e.maps = self._maps(expert_maps, keep)
            e.n_maps = 0 if expert_maps is None else len(expert_maps)
            e.map_len = cfg.n_expert
            a.route_ids, a.route_ids_len = out_pointer(
                route_ids, torch.int32, (cfg.n_layer, n_k), "route_ids"
            )
            a.route_logits, a.route_logits_len = out_pointer(
                route_logits, torch.float32, (cfg.n_layer, cfg.n_expert), "route_logits"
            )
            self._keep = keep
            self._extras = extras or expert_maps is not None

    def set_logits(self, logits: torch.Tensor) -> None:
        """The logits tensor (float32, contiguous, allocated by the caller) the call writes."""
        self.args.logits = self._ffi.cast(cpu_core._P_FLOAT, logits.data_ptr())
        self.args.logits_len = logits.numel()
