"""Building the hybrid executor for pyruntime.Model: the plan's slots, the chosen expert home,
the C core, and the costs (measured once per machine, model shape and staging mode, then read
from options.cache_dir()/offload); and the one-line error a CUDA out-of-memory becomes.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import sys
import traceback
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import torch

from pyruntime import options
from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.threads import resolve_threads
from pyruntime.errors import DeviceMemoryError, UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.gguf.quant import FORMAT_NAMES
from pyruntime.model.config import ModelConfig
from pyruntime.model.weights import HostWeights
from pyruntime.offload.costs import Costs, costs_key, load_or_measure, measure_costs
from pyruntime.offload.executor import HybridExecutor
from pyruntime.offload.plan import OffloadPlan, gib


def staging_mode(staging: str | None, pin_experts: bool) -> str:
    """--staging (auto, register, bounce, pinned) and --pin-experts -> the home to open."""
    mode = "pinned" if pin_experts else (staging or "auto")
    if mode not in options.STAGING:
        raise UsageError(f"--staging must be one of {', '.join(options.STAGING)}, got {mode!r}")
    # register until the device run says otherwise: no CPU copy beside the expert compute, no
    # second copy of the experts in RAM
    return "register" if mode == "auto" else mode


@contextlib.contextmanager
def device_memory_guard(what: str, device: str, budget: int | None = None) -> Iterator[None]:
    """A CUDA out-of-memory inside becomes a DeviceMemoryError naming `what` and the budget,
    after the partly built tensors are released (the caller holds no reference to them)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        # The finished frames of the traceback hold the tensors made so far: clear them, so
        # collecting frees those tensors now.
        traceback.clear_frames(exc.__traceback__)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        within = f" within a budget of {gib(budget)}" if budget is not None else ""
        raise DeviceMemoryError(
            f"the GPU ran out of memory {what} on {device}{within}: lower --gpu-mem (other "
            "processes may be using the GPU) or --ctx-size, or use --device cpu"
        ) from None


def load_hybrid(f: GGUFFile, cfg: ModelConfig, plan: OffloadPlan, device: str, *,
                threads: int | None = None, staging: str | None = None,
                pin_experts: bool = False, cache_policy: str = "lfru", misses: str = "auto",
                lookahead: bool = False, kernel_tuning: str | None = None,
                thresholds: list[float] | None = None) -> HybridExecutor:  # fmt: skip
    """The hybrid executor of `plan` on `device`, its costs measured or read from the cache."""
    core = cpu_core.CpuCore(resolve_threads(threads))  # capped and warned as the CPU path's
    net = HybridExecutor(
        cfg, HostWeights.from_gguf(f, cfg), device, core, slots=plan.slots,
        staging=staging_mode(staging, pin_experts), policy=cache_policy, misses="cpu",
        lookahead=lookahead, staging_buffer=plan.staging_buffer or None,
        kernel_tuning=kernel_tuning, file=f,
    )  # fmt: skip
    net.set_expert_threshold(thresholds)
    costs = None
    # auto splits by the costs in transit slots only (a cache stages every miss); direct reads
    # its share of the misses from them, and its prefill splits as auto
    split = misses == "direct" or (misses == "auto" and not net.experts.slots_keep)
    if split and plan.slots:
        costs = load_or_measure(
            _key(net, core, cfg, device), options.cache_dir() / "offload",
            lambda: measure_costs(net), _announce,
        )  # fmt: skip
    net.set_misses(misses, costs)
    return net


def _key(net: HybridExecutor, core: cpu_core.CpuCore, cfg: ModelConfig, device: str) -> str:
    """What the costs depend on: the machine (GPU, CPU, threads), the experts' shape and
    format, the staging mode, and the cost model's fields (a file of an older model, without
    the host's queueing times, is measured again)."""
    gpu = torch.cuda.get_device_name(torch.device(device)) if device != "cpu" else "cpu"
    first = net.host.blocks[net.moe_layers()[0]].experts
    return costs_key(
        gpu=gpu, cpu=platform.processor() or platform.machine(), threads=core.threads,
        simd=cpu_core.simd_level(), format=FORMAT_NAMES[first.qtype], n_embd=cfg.n_embd,
        n_ff=cfg.n_ff_exp, k=cfg.n_expert_used, staging=net.home.mode, fields=len(fields(Costs)),
    )  # fmt: skip


def _announce(path: Path) -> None:
    print(f"pyruntime: measuring the offload costs on this machine (once per machine and model "
          f"shape; cached in {path.parent})", file=sys.stderr, flush=True)  # fmt: skip
