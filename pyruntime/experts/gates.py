"""The routed experts' gate rows apart: a CPU-side copy the sparse expert kernel's gate pass reads.

The GGUF keeps each neuron's gate, up and down rows together (docs/gguf-layout.md), so that a
kept neuron's up and down rows are one gather. The sparse kernel must still read every gate row,
and there those are every third row: on one or two cores such a strided stream reads at 0.47-0.6
of the contiguous rate (bench/cpu_sparse_read.c), which caps the sparse speedup well below the
bytes it saves. This copy holds each expert's gate rows contiguous, [n_expert, n_ff, row_bytes]
per layer, in anonymous memory (a third of the routed experts' bytes; huge pages where the
system gives them on request), made once at load by
streaming the mapped tensor expert by expert; the kernel's gate pass reads it and gathers the
kept neurons' up and down rows from the GGUF as before (pyrt_experts.gates: the same values, so
the same bits). Dense decode and prefill never read it.

Whether to make it: `gate_copy` (pyruntime.options): on, off, or auto: when sparsity is on for
the CPU's decode steps and the copy fits beside the model in RAM (MemAvailable against the model
file, the copy and HEADROOM_BYTES); skipped with a one-line warning when it does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pyruntime.errors import PyruntimeWarning, UsageError
from pyruntime.experts.store import ExpertStore
from pyruntime.gguf.file import huge_page_array

GATE_COPY_MODES = ("auto", "on", "off")
HEADROOM_BYTES = 1 << 30  # RAM left free beside the model and its copy (KV cache, buffers)


def gates_apart(store: ExpertStore) -> np.ndarray:
    """uint8 [n_expert, n_ff, row_bytes]: every neuron's gate row of the layer, each expert's
    contiguous, in anonymous memory on 2 MiB pages where the system gives them
    (pyruntime.gguf.file.huge_page_array: the gate stream then walks 2 MiB pages, 1.02-1.08x
    faster sparse steps on granite at 1-2 threads, sparsity 0.5-0.9, 7 alternations against
    4 KiB pages); copied one expert at a time, straight from the mapped tensor (no
    temporary)."""
    rb = store.row_bytes
    out = huge_page_array(store.n_expert * store.n_ff * rb).reshape(store.n_expert, store.n_ff, rb)
    src = store.raw_bytes().reshape(store.n_expert, store.n_ff, 3, rb)
    for e in range(store.n_expert):
        out[e] = src[e, :, 0, :]
    return out


def copy_bytes(stores: Sequence[ExpertStore]) -> int:
    """Bytes the gate copies of these layers take: a third of their routed experts."""
    return sum(s.n_expert * s.n_ff * s.row_bytes for s in stores)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of RAM available without swapping (MemAvailable), or None where
    there is no such file (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fits(extra: int, model_bytes: int, available: int | None) -> bool:
    """Whether `extra` bytes of copies fit beside a model file of `model_bytes`: MemAvailable
    counts the page cache, the mapped model's pages among them, as available, so it must hold
    the whole file, the copies and HEADROOM_BYTES for the model to stay resident. Unknown RAM
    (available None): yes, as without the check."""
    return available is None or extra + model_bytes + HEADROOM_BYTES <= available


def decide(mode: str, sparse: bool, stores: Sequence[ExpertStore], model_bytes: int,
           available: int | None) -> bool:  # fmt: skip
    """Whether to make the gate copies: `mode` on / off, or auto (sparse decode on and it fits;
    a one-line PyruntimeWarning when it does not)."""
    if mode not in GATE_COPY_MODES:
        raise UsageError(f"gate_copy must be one of {', '.join(GATE_COPY_MODES)}, got {mode!r}")
    if mode != "auto" or not sparse or not stores:
        return mode == "on" and bool(stores)
    extra = copy_bytes(stores)
    if fits(extra, model_bytes, available):
        return True
    warnings.warn(
        f"not copying the experts' gate rows apart ({extra / 2**30:.2f} GiB; "
        f"{(available or 0) / 2**30:.2f} GiB of RAM available): sparse decode steps read them "
        "from the model file (slower on few cores; --gate-copy on forces the copy)",
        PyruntimeWarning,
        stacklevel=2,
    )
    return False
