"""The Gated DeltaNet kernels (kernels/deltanet.py: the fused decode step) and the GPU prompt
path (gpu/deltanet.py) vs the torch reference (model/deltanet.py), at odd shapes (head dims and
channel counts that are not powers of two, a key head serving several value heads, conv kernels
of 3 and 4), over several consecutive decode steps (the conv and ssm states carried in place),
and the chunked prefill kernels (kernels/deltanet_chunk.py) from a state, at lengths around the
chunk of 64 and in pieces across chunk edges followed by decode steps. float32 unless said:
the tolerance is f32 rounding of a few dot products (measured ~1e-7); a wrong decay, beta or
state shift is O(0.1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from gpu_device import DEVICE

from pyruntime.gpu.deltanet import deltanet_prefill
from pyruntime.kernels import deltanet as dk_kernels
from pyruntime.model import deltanet as ref

TOL = 1e-5


def _cfg(hk, hv, dk, dv, K):
    return SimpleNamespace(ssm_n_k_heads=hk, ssm_n_v_heads=hv, ssm_head_k_dim=dk,
                           ssm_head_v_dim=dv, ssm_conv_kernel=K, rms_eps=1e-6,
                           ssm_conv_channels=2 * hk * dk + hv * dv)  # fmt: skip


def _weights(cfg, gen):
    C, hv = cfg.ssm_conv_channels, cfg.ssm_n_v_heads
    w = dict(
        conv=torch.randn(C, cfg.ssm_conv_kernel, generator=gen) * 0.5,
        a=-torch.rand(hv, generator=gen) * 3,
        dt_bias=torch.randn(hv, generator=gen),
        norm=torch.randn(cfg.ssm_head_v_dim, generator=gen),
    )
    return {k: t.to(DEVICE) for k, t in w.items()}


def _reference(cfg, w, proj, conv_state, ssm_state, form):
    """The reference layer from the fused projection (model/deltanet.py's pieces)."""
    hk, hv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    C, T = cfg.ssm_conv_channels, proj.shape[0]
    z, b, alpha = torch.split(proj[:, C:], [hv * dv, hv, hv], dim=-1)
    mixed, conv_state = ref.causal_conv(proj[:, :C], conv_state, w["conv"])
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = (ref.l2norm(q.reshape(T, hk, dk)) * dk**-0.5).repeat_interleave(hv // hk, dim=1)
    k = ref.l2norm(k.reshape(T, hk, dk)).repeat_interleave(hv // hk, dim=1)
    g = w["a"] * F.softplus(alpha + w["dt_bias"])
    o, ssm_state = form(q, k, v.reshape(T, hv, dv), g, torch.sigmoid(b), ssm_state)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * w["norm"]
    return (o * F.silu(z.reshape(T, hv, dv))).reshape(T, -1), conv_state, ssm_state


def _decode(cfg, w, proj_row, conv, ssm):
    return dk_kernels.decode_step(cfg, proj_row.contiguous(), conv, w["conv"], ssm, w["a"],
                                  w["dt_bias"], w["norm"], torch.float32)  # fmt: skip


# (Hk, Hv, dk, dv, K): one head; 2 and 3 value heads per key head (the q/k conv state, read by
# each of them, shifted once by the last: a shift before another's read is O(1) off).
@pytest.mark.parametrize("shape", [(1, 1, 16, 16, 4), (3, 6, 12, 20, 4), (2, 6, 7, 9, 3)])
def test_decode_steps_match_the_recurrence(shape):
    cfg = _cfg(*shape)
    gen = torch.Generator().manual_seed(sum(shape))
    w = _weights(cfg, gen)
    C, hv, dv = cfg.ssm_conv_channels, cfg.ssm_n_v_heads, cfg.ssm_head_v_dim
    T = 6
    proj = torch.randn(T, C + hv * dv + 2 * hv, generator=gen).to(DEVICE)
    conv0 = torch.randn(C, cfg.ssm_conv_kernel - 1, generator=gen).to(DEVICE)
    ssm0 = torch.randn(hv, cfg.ssm_head_k_dim, dv, generator=gen).to(DEVICE)
    want, conv_want, ssm_want = _reference(cfg, w, proj, conv0, ssm0, ref.recurrent)
    conv, ssm = conv0.clone(), ssm0.clone()
    for t in range(T):
        got = _decode(cfg, w, proj[t], conv, ssm)
        assert (got[0] - want[t]).abs().max() <= TOL, t
    assert (conv - conv_want).abs().max() <= TOL
    assert (ssm - ssm_want).abs().max() <= TOL


def _prompt_case(cfg, T, seed):
    gen = torch.Generator().manual_seed(seed)
    w = _weights(cfg, gen)
    C, hv, dv = cfg.ssm_conv_channels, cfg.ssm_n_v_heads, cfg.ssm_head_v_dim
    proj = torch.randn(T, C + hv * dv + 2 * hv, generator=gen)
    conv0 = torch.randn(C, cfg.ssm_conv_kernel - 1, generator=gen)
    ssm0 = torch.randn(hv, cfg.ssm_head_k_dim, dv, generator=gen)
    return w, proj.to(DEVICE), conv0.to(DEVICE), ssm0.to(DEVICE)


def _prefill(cfg, w, proj, conv, ssm, out_dtype=torch.float32):
    return deltanet_prefill(cfg, proj, w["conv"], conv, ssm, w["a"], w["dt_bias"], w["norm"],
                            out_dtype)  # fmt: skip


# 1, 7: inside one chunk (and under the conv's K - 1); 63, 64, 65: at the chunk's edge; 300: five
# chunks, the last partial. Tolerance: T steps of f32 against the chunked solve (300 measured
# ~2e-5; a wrong decay across a chunk or a state not carried is O(0.1)).
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 300])
def test_prefill_matches_the_recurrence_from_a_state(T):
    cfg = _cfg(2, 4, 12, 20, 4)
    w, proj, conv0, ssm0 = _prompt_case(cfg, T, T)
    want, conv_want, ssm_want = _reference(cfg, w, proj, conv0, ssm0, ref.recurrent)
    conv, ssm = conv0.clone(), ssm0.clone()
    got = _prefill(cfg, w, proj, conv, ssm)
    assert (got - want).abs().max() <= 1e-4
    assert torch.equal(conv, conv_want) and (ssm - ssm_want).abs().max() <= 1e-4


@pytest.mark.parametrize("shape", [(1, 1, 16, 16, 4), (3, 6, 7, 9, 3)])
def test_prefill_in_pieces_then_decode_is_token_by_token(shape):
    """Prompts split across chunk edges (30 + 70 + 1 + 5 tokens), each starting from the state
    the one before left, then decode steps: the outputs and states of the recurrence token by
    token; strided proj rows (the fused projection's qkv columns) and a bf16 output."""
    cfg = _cfg(*shape)
    T = 110
    w, proj, conv0, ssm0 = _prompt_case(cfg, T, sum(shape))
    want, conv_want, ssm_want = _reference(cfg, w, proj, conv0, ssm0, ref.recurrent)
    conv, ssm = conv0.clone(), ssm0.clone()
    wide = torch.zeros(T, proj.shape[1] + 5, device=DEVICE)
    wide[:, : proj.shape[1]] = proj  # rows of stride > width
    start = 0
    for n in (30, 70, 1, 5):
        half = _prefill(cfg, w, proj[start : start + n], conv.clone(), ssm.clone(), torch.bfloat16)
        got = _prefill(cfg, w, wide[start : start + n, : proj.shape[1]], conv, ssm)
        assert (got - want[start : start + n]).abs().max() <= 1e-4, (start, n)
        assert half.dtype == torch.bfloat16
        assert (half.float() - got).abs().max() <= 2e-2 * got.abs().max()
        start += n
    for t in range(start, T):
        got = _decode(cfg, w, proj[t], conv, ssm)
        assert (got[0] - want[t]).abs().max() <= 1e-4, t
    assert (conv - conv_want).abs().max() <= TOL and (ssm - ssm_want).abs().max() <= 1e-4
