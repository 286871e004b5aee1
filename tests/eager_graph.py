"""A stand-in for CUDA graph capture on the CPU (tests of pyruntime.gpu.executor's graph path).

`use_eager_graphs(monkeypatch, executor)` turns the executor's CUDA graphs on and replaces
pyruntime.gpu.cache_state.capture: the "capture" runs the step once (as the real capture's
warm-up run does) and returns an EagerGraph whose replay() runs the step again and writes its
results into the tensors the capture returned. Like a real graph it reads every input from the
step's device tensors at replay time, so a test sees what a replayed graph would compute.
"""

from __future__ import annotations

import torch

from pyruntime.gpu import cache_state


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for item in tree for t in _tensors(item)]


class EagerGraph:
    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs

    def replay(self) -> None:
        with torch.inference_mode():
            for dst, src in zip(_tensors(self.outputs), _tensors(self.fn()), strict=True):
                dst.copy_(src)


def use_eager_graphs(monkeypatch, executor) -> list[int]:
    """Returns a list that gets one entry per capture."""
    captures: list[int] = []

    def capture(fn, device):
        captures.append(1)
        outputs = fn()  # the warm-up run
        return EagerGraph(fn, outputs), outputs

    monkeypatch.setattr(cache_state, "capture", capture)
    executor.cuda_graphs = True
    return captures
