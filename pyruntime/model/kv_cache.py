"""The KV cache of one sequence: keys and values of the positions it has seen, for every layer.

One class for every executor. Layer i's storage kv[i] is [2, n_head_kv, capacity, head_dim]:
k[i] = kv[i][0] and v[i] = kv[i][1], each contiguous [n_head_kv, capacity, head_dim] (the layout
the C decode step and the GPU kernels read). Positions [0, n_tokens) hold valid entries.

- growable (the host's default): capacity grows in chunks as tokens arrive, so a large
  max_tokens costs nothing up front; growing reallocates the storage.
- fixed (growable=False; a captured CUDA graph needs fixed addresses): capacity = max_tokens
  from the start, one allocation, the storage never moves.

`executor_state` is where an executor keeps what it derived from this storage (the C core's
pointers, captured CUDA graphs and their input buffers); it is cleared whenever the storage moves.
Rewinding (dropping the newest positions) only moves n_tokens: the next tokens overwrite them.

A multi-head latent attention model (deepseek2) caches per position one latent and rope key
(head_dim = kv_lora_rank + rope dims, one kv head) that serves as keys and values both: its
storage is [1, 1, capacity, head_dim] per layer and k[i] and v[i] are the same view.

A model with Gated DeltaNet layers (qwen35moe) keeps no keys or values for them (their storage
has no positions) but a recurrent state (`recurrent`, pyruntime.model.recurrent_state), which
cannot be cut back: going back to a position without a snapshot of it empties the cache
(n_tokens 0), so check n_tokens after truncate().
"""

from __future__ import annotations

from typing import Any

import torch

from pyruntime.errors import UsageError
from pyruntime.model.config import ModelConfig
from pyruntime.model.recurrent_state import RecurrentState


class KVCache:
    _CHUNK = 256  # positions added per growth of a growable cache

    def __init__(
        self,
        cfg: ModelConfig,
        max_tokens: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        growable: bool = True,
    ) -> None:
        if max_tokens < 1:
            raise UsageError(f"context size must be at least 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.n_tokens = 0
        self.device = torch.device(device)
        self.dtype = dtype
        self.growable = growable
        self._n_layer, self._n_head_kv, self._head_dim = cfg.n_layer, cfg.n_head_kv, cfg.head_dim
        self._keyless = [cfg.is_recurrent(i) for i in range(cfg.n_layer)]
        self._planes = 1 if cfg.is_mla else 2  # MLA: one latent for keys and values
        self.recurrent = (
            RecurrentState(cfg, self.device) if any(self._keyless) else None
        )  # the DeltaNet layers' conv and ssm states
        self.executor_state: dict[str, Any] = {}
        self._capacity = 0
        self._allocate(0 if growable else max_tokens)

    @property
    def capacity(self) -> int:
        """Positions the storage holds now (<= max_tokens)."""
        return self._capacity

    def _allocate(self, capacity: int) -> None:
        """New storage of `capacity` positions holding the first n_tokens of the old one, made
        layer by layer (a growth holds one extra layer at a time, not a second cache)."""
        old = getattr(self, "kv", None)
        kv = []
        for layer in range(self._n_layer):
            positions = 0 if self._keyless[layer] else capacity
            shape = (self._planes, self._n_head_kv, positions, self._head_dim)
            t = torch.zeros(shape, device=self.device, dtype=self.dtype)
            if old is not None and self.n_tokens:
                t[:, :, : self.n_tokens] = old[layer][:, :, : self.n_tokens]
                old[layer] = self.k[layer] = self.v[layer] = None  # free the old layer now
            kv.append(t)
        self.kv = kv  # per layer [2 (MLA: 1), n_head_kv, capacity, head_dim]
        self.k = [t[0] for t in kv]  # per layer [n_head_kv, capacity, head_dim]
        self.v = [t[-1] for t in kv]
        self._capacity = capacity
        self.executor_state.clear()

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more positions (UsageError when the context is full)."""
        need = self.n_tokens + n_new
        if need > self.max_tokens:
            raise UsageError(
                f"context is full: {self.n_tokens} tokens cached + {n_new} new > context size "
                f"{self.max_tokens} (raise --ctx-size / n_ctx, or start a new conversation)"
            )
        if need > self.capacity:
            self._allocate(min(self.max_tokens, max(need, self.capacity + self._CHUNK)))

    def truncate(self, n: int) -> None:
        """Keep the first n positions, forget the rest (a common prefix kept for reuse); with a
        recurrent state, all of them unless it has a snapshot at n (see the module's doc)."""
        n = max(0, min(n, self.n_tokens))
        if self.recurrent is not None and n < self.n_tokens:
            if n == 0 or not self.recurrent.restore(n):
                self.recurrent.reset()
                n = 0
        self.n_tokens = n

    def end_pass(self, n_tokens: int, n_new: int) -> None:
        """A forward pass of n_new tokens left the cache holding n_tokens; a prompt's recurrent
        state is kept as a snapshot (a later prompt sharing it goes back to it)."""
        self.n_tokens = n_tokens
        if self.recurrent is not None and n_new > 1:
            self.recurrent.snapshot(n_tokens)

    def rewind(self, n: int) -> None:
        """Forget the newest n positions (0 <= n <= n_tokens)."""
        if not 0 <= n <= self.n_tokens:
            raise UsageError(f"cannot rewind {n} positions of a cache holding {self.n_tokens}")
        if self.recurrent is not None and n and not self.recurrent.restore(self.n_tokens - n):
            raise UsageError(
                f"cannot rewind {n} positions: the model's recurrent (DeltaNet) state has no "
                "snapshot there; a recurrent model only goes back to the end of a prompt"
            )
        self.n_tokens -= n
