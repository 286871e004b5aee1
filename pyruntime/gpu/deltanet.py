"""A Gated DeltaNet layer's prompt on the GPU: the causal conv over the prompt in one kernel and
the chunked form of the recurrence (kernels.deltanet_chunk: chunks of 64 tokens, the
intra-chunk solve parallel over chunks and heads, the state passed from chunk to chunk in
registers, then the gated RMSNorm): four launches per layer whatever the prompt's length. One
token takes the decode kernel (kernels.deltanet) instead."""

from __future__ import annotations

import torch

from pyruntime.kernels.deltanet_chunk import causal_conv, chunked_delta


def deltanet_prefill(cfg, proj: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
                     ssm_state: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                     norm: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """T tokens: proj [T, C + Hv dv + 2 Hv] -> gated, normed output [T, Hv dv] in out_dtype; the
    conv and ssm states updated in place (pyruntime.model.deltanet's chunked form)."""
    mixed = causal_conv(proj[:, : cfg.ssm_conv_channels], conv_state, conv_w)
    return chunked_delta(cfg, mixed, proj, ssm_state, a, dt_bias, norm, out_dtype)
