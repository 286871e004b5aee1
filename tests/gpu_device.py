"""The device a test of the GPU code runs it on: torch's CPU device under the Triton interpreter
(TRITON_INTERPRET=1, set by conftest.py: CI and this 2-core box), the GPU otherwise."""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


# Two runs of the same kernels (eager vs a replayed graph, one call vs pieces): bit for bit under
# the interpreter; on a GPU several kernels add partial sums with atomics (split-K attention,
# down projections), whose order changes from run to run (float32 rounding, ~1e-6 relative).
RERUN_TOL = 0.0 if DEVICE == "cpu" else 1e-4


def assert_same_run(a: torch.Tensor, b: torch.Tensor) -> None:
    """a and b: logits of the same computation run twice (see RERUN_TOL)."""
    if RERUN_TOL == 0.0:
        assert torch.equal(a, b)
    else:
        err = (a.double() - b.double()).abs().max().item()
        assert err <= RERUN_TOL, err
