"""Where a model runs: `--device auto|cpu|cuda` (and `cuda:N`) under a GPU budget (`--gpu-mem`).

auto and cuda: the whole model on the GPU when it fits the budget; else hybrid (dense weights
and the KV cache on the GPU, routed experts in host memory, the rest of the budget as GPU
expert slots: pyruntime.offload). auto takes the CPU when there is no GPU, the experts'
activation has no GPU kernel, or the budget cannot hold even the dense part (saying why, when a
GPU was there); cuda makes each of those a one-line error. cpu: the CPU, always.

The budget defaults to what torch can allocate on the GPU now, minus DEFAULT_MARGIN: the driver's
free memory, capped by torch's own limit (set_per_process_memory_fraction), plus what torch
holds cached. The driver's figure alone overstates it when the allocator is capped, and loading
would then die in an out-of-memory error halfway.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from pyruntime.errors import DeviceMemoryError, PyruntimeWarning, UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.model.config import ModelConfig
from pyruntime.offload.plan import OffloadPlan, device_bytes, gib, plan_budget

DEVICES = ("auto", "cpu", "cuda")
# Left free by the default budget: what lives outside the estimate (cuBLAS workspaces, Triton
# modules, CUDA graph pools, the allocator's fragmentation). llama.cpp's --fit keeps 1 GiB.
DEFAULT_MARGIN = 512 << 20


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cpu" or "cuda[:N]"
    note: str | None  # why auto chose the CPU although a GPU exists (None otherwise)
    plan: OffloadPlan | None = None  # the hybrid's plan; None: the whole model on `device`

    @property
    def hybrid(self) -> bool:
        return self.plan is not None


def allocatable_bytes(dev: torch.device) -> int:
    """Bytes torch can allocate on `dev` now: the driver's free memory, capped by torch's
    per-process limit, plus the free part of torch's cache."""
    index = dev.index  # None: the current device (torch.device("cuda") is refused by some calls)
    free, total = torch.cuda.mem_get_info(index)
    try:
        reserved = torch.cuda.memory_reserved(index)
        allocated = torch.cuda.memory_allocated(index)
        fraction = torch.cuda.get_per_process_memory_fraction(index)
    except (RuntimeError, AssertionError, AttributeError):  # no allocator to ask
        return int(free)
    cap = int(fraction * total) - reserved  # what torch may still reserve
    return max(0, min(int(free), cap)) + max(0, reserved - allocated)


def gpu_budget(dev: torch.device, gpu_mem: int | None) -> tuple[int, str]:
    """(the budget on `dev`, where it came from): gpu_mem, or allocatable_bytes minus
    DEFAULT_MARGIN. A gpu_mem above what can be allocated is lowered to that (minus the
    margin), with a warning."""
    can = allocatable_bytes(dev)
    if gpu_mem is not None and gpu_mem <= can:
        return gpu_mem, "--gpu-mem"
    lowered = max(0, can - DEFAULT_MARGIN)
    source = f"{gib(can)} is free on {torch.cuda.get_device_name(dev)}, less a " \
             f"{gib(DEFAULT_MARGIN)} margin"  # fmt: skip
    if gpu_mem is not None:
        warnings.warn(f"--gpu-mem {gib(gpu_mem)} is more than torch can allocate now: {source}",
                      PyruntimeWarning, stacklevel=3)  # fmt: skip
    return lowered, source


def choose_device(requested: str, f: GGUFFile, cfg: ModelConfig, n_ctx: int,
                  gpu_mem: int | None = None) -> DeviceChoice:  # fmt: skip
    """Resolve `requested` for this model at a context of n_ctx tokens under a GPU budget of
    gpu_mem bytes (None: the default; see the module doc)."""
    req = (requested or "auto").lower()
    if req not in DEVICES and not req.startswith("cuda:"):
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got '{requested}'")
    if gpu_mem is not None and (not isinstance(gpu_mem, int) or gpu_mem < 0):
        raise UsageError(f"gpu_mem must be a number of bytes >= 0, got {gpu_mem!r}")
    if req == "cpu":
        return DeviceChoice("cpu", None)
    if not torch.cuda.is_available():
        if req == "auto":
            return DeviceChoice("cpu", None)
        raise UsageError(
            f"--device {requested}: no CUDA GPU is available to torch (torch "
            f"{torch.__version__}); use --device cpu or auto"
        )
    from pyruntime.kernels.expert_formats import activation_issue

    why = activation_issue(cfg.activation, (cfg.swiglu_alpha, cfg.swiglu_limit))
    if why is not None:
        if req == "auto":
            return DeviceChoice("cpu", f"running on the CPU: {why}")
        raise UsageError(f"--device {requested}: {why}; use --device cpu")
    dev = torch.device("cuda" if req == "auto" else req)
    try:
        budget, source = gpu_budget(dev, gpu_mem)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise UsageError(f"--device {requested}: {str(exc).splitlines()[0]}") from None
    try:
        plan = plan_budget(device_bytes(f, cfg, n_ctx), budget, n_ctx, source)
    except DeviceMemoryError as exc:
        if req == "auto":
            return DeviceChoice("cpu", f"running on the CPU: {exc}")
        raise DeviceMemoryError(f"--device {requested}: {exc}") from None
    return DeviceChoice(str(dev), None, None if plan.whole_model else plan)
