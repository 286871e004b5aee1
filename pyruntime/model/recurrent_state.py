"""The recurrent state of one sequence for a model's Gated DeltaNet layers (qwen35moe), kept in
its KVCache beside the keys and values of the full-attention layers.

Per DeltaNet layer i: conv[i] [C, K - 1] (the conv's last K - 1 inputs) and ssm[i] [Hv, dk, dv]
(the delta rule's state per value head), float32. Unlike keys and values, a state cannot be cut
back to an earlier position: it is the sum of every token so far. So the state after each
multi-token forward pass (a prompt) is kept as a snapshot (the newest `KEEP` of them), and going
back to a position restores the snapshot taken there, or else starts the sequence over from
position 0 (the caller then evaluates the whole prompt again, as llama.cpp does).
"""

from __future__ import annotations

import torch

KEEP = 2  # snapshots kept (each holds every DeltaNet layer's conv and ssm state)


class RecurrentState:
    def __init__(self, cfg, device: torch.device) -> None:
        self.layers = [i for i in range(cfg.n_layer) if cfg.is_recurrent(i)]
        C, K = cfg.ssm_conv_channels, cfg.ssm_conv_kernel
        shape = (cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim)
        f32 = dict(device=device, dtype=torch.float32)
        self.conv = {i: torch.zeros((C, K - 1), **f32) for i in self.layers}
        self.ssm = {i: torch.zeros(shape, **f32) for i in self.layers}
        self._snapshots: dict[int, tuple[dict, dict]] = {}  # position -> (conv, ssm) clones

    def reset(self) -> None:
        """The state of an empty sequence (zeros), snapshots dropped."""
        for i in self.layers:
            self.conv[i].zero_()
            self.ssm[i].zero_()
        self._snapshots.clear()

    def copy(self) -> tuple[dict, dict]:
        """A copy of the state (conv, ssm by layer)."""
        return (
            {i: t.clone() for i, t in self.conv.items()},
            {i: t.clone() for i, t in self.ssm.items()},
        )

    def load(self, saved: tuple[dict, dict]) -> None:
        """The state of a copy(), written into this state's tensors (their addresses stay: a
        captured decode step reads and writes them)."""
        for i in self.layers:
            self.conv[i].copy_(saved[0][i])
            self.ssm[i].copy_(saved[1][i])

    def snapshot(self, position: int) -> None:
        """Keep the state as it is after `position` tokens."""
        self._snapshots[position] = self.copy()
        for old in sorted(self._snapshots)[:-KEEP]:
            del self._snapshots[old]

    def restore(self, position: int) -> bool:
        """Go back to the state after `position` tokens; False when no snapshot holds it."""
        saved = self._snapshots.get(position)
        if saved is None:
            return False
        self.load(saved)
        for later in [p for p in self._snapshots if p > position]:
            del self._snapshots[later]
        return True
