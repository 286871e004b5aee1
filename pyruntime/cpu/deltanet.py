"""A Gated DeltaNet layer's decode step on the C core (pyrt_deltanet_step, runtime/src/deltanet.c).

One token of a DeltaNet layer is one C call: the four in-projections in one matvec task over the
pool, the causal conv, the delta rule per value head on the cache's state (updated in place), the
gated RMSNorm and the out-projection; in torch it was ~20 small ops (the recurrent form of
pyruntime.model.deltanet), whose per-op cost dominated a step's layer on few cores. A prompt
keeps the chunked torch form (its matrices on the C core).
"""

from __future__ import annotations

import torch

from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.core import CpuCore
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model.config import ModelConfig
from pyruntime.model.deltanet import DeltaNetWeights
from pyruntime.model.weights import HostWeights


class CDeltaNet:
    """The pyrt_deltanet description of each DeltaNet layer of a model (built once; the buffers
    they borrow kept here), and `step` to run one token through a layer."""

    def __init__(self, cfg: ModelConfig, weights: HostWeights, core: CpuCore) -> None:
        self.core = core
        self._ffi = cpu_core._ffi
        self._lib = cpu_core._lib()
        self._keep: list[object] = []
        self._layers = {
            i: self._describe(cfg, blk.deltanet)
            for i, blk in enumerate(weights.blocks)
            if blk.deltanet is not None
        }
        self.n_embd = cfg.n_embd
        self._p_float = self._ffi.typeof("float *")
        self._p_cfloat = self._ffi.typeof("const float *")

    def _vector(self, dst, t: torch.Tensor) -> None:
        t = t.detach().to(torch.float32).contiguous().reshape(-1)
        self._keep.append(t)
        dst.data = self._ffi.cast("const float *", t.data_ptr())
        dst.n = t.numel()

    def _matrix(self, dst, m: QuantMatrix) -> None:
        buf = self._ffi.from_buffer(m.raw)
        self._keep.append(buf)
        dst.data, dst.bytes, dst.fmt = buf, m.raw.nbytes, int(m.qtype)
        dst.n_out, dst.n_in = m.shape

    def _describe(self, cfg: ModelConfig, w: DeltaNetWeights):
        d = self._ffi.new("pyrt_deltanet *")
        d.n_embd, d.n_k_heads, d.n_v_heads = cfg.n_embd, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads
        d.head_k_dim, d.head_v_dim = cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
        d.conv_kernel, d.rms_eps = cfg.ssm_conv_kernel, cfg.rms_eps
        for name in ("qkv", "gate", "beta", "alpha", "out"):
            self._matrix(getattr(d, name), getattr(w, name))
        for name in ("conv", "dt_bias", "a", "norm"):
            self._vector(getattr(d, name), getattr(w, name))
        self._keep.append(d)
        return d

    def step(self, layer: int, x: torch.Tensor, conv: torch.Tensor,
             ssm: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """x [1, n_embd] f32 (the normed input) -> the layer's output [1, n_embd]; conv
        [C, K - 1] and ssm [Hv, dk, dv] (contiguous f32 on the CPU) advanced in place."""
        if self.core._pool is None:
            raise cpu_core.CoreError("CpuCore is closed: create a new one")
        x = cpu_core._as_cpu(x, torch.float32, "x", 2)
        if x.shape != (1, self.n_embd):
            raise cpu_core.CoreError(f"x has shape {tuple(x.shape)}, expected (1, {self.n_embd})")
        for name, t in (("conv_state", conv), ("ssm_state", ssm)):
            if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
                raise cpu_core.CoreError(f"{name} must be a contiguous float32 CPU tensor")
        y = torch.empty((1, self.n_embd), dtype=torch.float32)
        cpu_core._check(
            self._lib.pyrt_deltanet_step(
                self.core._pool,
                self._layers[layer],
                self._ffi.cast(self._p_cfloat, x.data_ptr()),
                self._ffi.cast(self._p_float, conv.data_ptr()),
                conv.numel(),
                self._ffi.cast(self._p_float, ssm.data_ptr()),
                ssm.numel(),
                self._ffi.cast(self._p_float, y.data_ptr()),
            ),
            "pyrt_deltanet_step",
        )
        return y
