"""kernels.host_flags: the step number, the signal a graph writes for the host, and the wait
that gives up. On a GPU the flags are page-locked host memory mapped for the device (as a step
graph's); under the Triton interpreter plain tensors stand in for it."""

import numpy as np
import torch

from kernels import host_flags
from kernels.testing import DEVICE
from pyruntime.offload.host_register import mapped_tensor, page_locked


def host_flags_of(rows: int, cols: int) -> tuple[np.ndarray, torch.Tensor]:
    """(the host's view, the kernels' tensor) of rows x cols int32 flags, all 0."""
    if DEVICE.type != "cuda":
        t = torch.zeros(rows, cols, dtype=torch.int32)
        return t.numpy(), t
    host = page_locked(rows * cols * 4).view(np.int32).reshape(rows, cols)
    host[:] = 0
    return host, mapped_tensor(host, DEVICE)


def done() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def test_advance_signal_and_wait():
    seq = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    host, flags = host_flags_of(2, 3)
    failed = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    host_flags.advance(seq)
    host_flags.advance(seq)
    assert seq.item() == 2
    host_flags.signal(flags[0], seq, 1)
    done()
    assert host.tolist() == [[0, 2, 0], [0, 0, 0]]
    host[1, 2] = 2  # the host's answer is there: the wait returns at once
    host_flags.wait(flags[1], seq, failed, 2, limit=1)
    assert failed.item() == 0


def test_a_wait_gives_up_and_says_so():
    seq = torch.ones(1, dtype=torch.int32, device=DEVICE)
    host, flags = host_flags_of(2, 2)
    failed = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    host_flags.wait(flags[1], seq, failed, 0, limit=5)
    assert failed.item() == 1
    host[1, 1] = 1
    host_flags.wait(flags[1], seq, failed, 1, limit=5)  # a later success keeps the failure
    assert failed.item() == 1
