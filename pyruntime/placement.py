"""Where a model runs: `--device auto|cpu|cuda` (and `cuda:N`).

auto: the GPU when torch sees one and the model plus its KV cache fit in the GPU's free memory,
else the CPU (with the reason when a GPU was there but could not be used). cuda: the GPU, or a
one-line error when there is none or the model does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyruntime.errors import UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.model.config import ModelConfig

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cpu" or "cuda[:N]"
    note: str | None  # why auto chose the CPU although a GPU exists (None otherwise)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose_device(requested: str, f: GGUFFile, cfg: ModelConfig, n_ctx: int) -> DeviceChoice:
    """Resolve `requested` for this model at a context of n_ctx tokens (see module doc)."""
    req = (requested or "auto").lower()
    if req not in DEVICES and not req.startswith("cuda:"):
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got '{requested}'")
    if req == "cpu":
        return DeviceChoice("cpu", None)
    if not torch.cuda.is_available():
        if req == "auto":
            return DeviceChoice("cpu", None)
        raise UsageError(
            f"--device {requested}: no CUDA GPU is available to torch (torch "
            f"{torch.__version__}); use --device cpu or auto"
        )
    from pyruntime.gpu.weights import device_bytes
    from pyruntime.kernels.expert_formats import ACT_CODES

    if cfg.activation not in ACT_CODES:
        why = f"expert activation '{cfg.activation}' has no GPU kernel"
        if req == "auto":
            return DeviceChoice("cpu", f"running on the CPU: {why}")
        raise UsageError(f"--device {requested}: {why}; use --device cpu")
    dev = torch.device("cuda" if req == "auto" else req)
    try:
        free, _total = torch.cuda.mem_get_info(dev)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise UsageError(f"--device {requested}: {str(exc).splitlines()[0]}") from None
    need = device_bytes(f, cfg, n_ctx)
    if need <= free:
        return DeviceChoice(str(dev), None)
    why = (
        f"the model and a {n_ctx}-token KV cache need {_gib(need)} of GPU memory, "
        f"{_gib(free)} is free on {torch.cuda.get_device_name(dev)}"
    )
    if req == "auto":
        return DeviceChoice("cpu", f"running on the CPU: {why}")
    raise UsageError(f"--device {requested}: {why} (use a smaller --ctx-size or --device cpu)")
