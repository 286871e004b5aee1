"""The C core's routed experts with gpt-oss's biases and clamped SwiGLU, against float64.

Per neuron j of expert e and route (t, w): g = g_j . x + bg_j, u = u_j . x + bu_j,
a = min(g, L) * sigmoid(alpha min(g, L)), h = w a (clamp(u, -L, L) + 1); y_t += h d_j, and once
per route y_t += w bd_e. Every format, dense and sparse (the threshold on |a|), with and without
an expert map (biases indexed by slot), at odd shapes; limit 0.8 so that the clamps bind for a
good share of the neurons (g, u ~ N(0, 1)).

Tolerance: test_cpu_core.py's first-order f32 bound (its module docstring), with the biases'
additions in it (|dg| <= eps_d (gabs + |bg|), likewise u) and the down bias's w bd terms in the
final sum's; the activation's Lipschitz constant is that of SiLU (g sigmoid(alpha g) =
silu(alpha g) / alpha), the clamps' and the up term's are 1. For Q8_0/Q4_0 the reference reads
the activation quantized as the kernel does.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_core import FORMATS, U, assert_within, default_n_embd, kernel_x, make_weights

ALPHA, LIMIT = 1.702, 0.8
LIPSCHITZ = 1.13


def reference(w, x, ids, topk_w, bias_gu, bias_down, threshold=None, threads=1, slot=None):
    """(y, n_active, |a| per (t, k, j), bound) in float64; slot: expert id -> index into w and
    the biases (None: the id itself)."""
    s = ids.long() if slot is None else slot[ids.long()]
    ws = w[s]  # [T, K, F, 3, D]
    bg, bu, bd = bias_gu[s][..., 0], bias_gu[s][..., 1], bias_down[s]
    g = torch.einsum("tkfd,td->tkf", ws[..., 0, :], x) + bg
    u = torch.einsum("tkfd,td->tkf", ws[..., 1, :], x) + bu
    gc = g.clamp(max=LIMIT)
    a = gc * torch.sigmoid(ALPHA * gc)
    up = u.clamp(-LIMIT, LIMIT) + 1
    keep = torch.ones_like(a, dtype=torch.bool) if threshold is None else a.abs() >= threshold
    tw = topk_w.double()[..., None]
    h = tw * a * up * keep
    y = torch.einsum("tkf,tkfd->td", h, ws[..., 2, :]) + torch.einsum("tk,tkd->td", tw[..., 0], bd)

    n_embd, k, n_ff = x.shape[1], ids.shape[1], w.shape[1]
    xa = x.abs()
    gabs = torch.einsum("tkfd,td->tkf", ws[..., 0, :].abs(), xa) + bg.abs()
    uabs = torch.einsum("tkfd,td->tkf", ws[..., 1, :].abs(), xa) + bu.abs()
    eps_d = (n_embd + 3) * U
    eps_r = (k * n_ff + k + threads + 2) * U
    dh = tw.abs() * (LIPSCHITZ * eps_d * gabs * up.abs() + a.abs() * eps_d * uabs)
    dh = dh + 6 * U * h.abs()  # sigmoid, clamp + 1, the products
    dabs = ws[..., 2, :].abs()
    sums = torch.einsum("tkf,tkfd->td", h.abs(), dabs) + torch.einsum(
        "tk,tkd->td", tw[..., 0].abs(), bd.abs()
    )
    bound = torch.einsum("tkf,tkfd->td", dh * keep, dabs) + eps_r * sums
    return y, int(keep.sum()), a.abs(), bound


def make_case(fmt, n_tokens, seed, n_expert=5, n_ff=37, k=3):
    gen = torch.Generator().manual_seed(seed)
    n_embd = default_n_embd(fmt)
    raw, w = make_weights(fmt, n_expert, n_ff, n_embd, gen)
    x = torch.randn(n_tokens, n_embd, generator=gen)
    ids = torch.stack([torch.randperm(n_expert, generator=gen)[:k] for _ in range(n_tokens)])
    topk_w = torch.rand(n_tokens, k, generator=gen)
    bias_gu = torch.randn(n_expert, n_ff, 2, generator=gen) * 0.5
    bias_down = torch.randn(n_expert, n_embd, generator=gen) * 0.1
    return raw, w, x, ids.to(torch.int32), topk_w, bias_gu, bias_down


def _threshold(abs_act: torch.Tensor) -> float:
    """A threshold in the widest gap between sorted |a| around the median (no |a| near it)."""
    vals = abs_act.flatten().sort().values
    lo, hi = int(0.4 * len(vals)), int(0.6 * len(vals))
    i = lo + int((vals[lo + 1 : hi + 1] - vals[lo:hi]).argmax())
    return float((vals[i] + vals[i + 1]) / 2)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_biased_clamped_swiglu_matches_reference(cc, simd, fmt, sparse):
    for n_tokens, threads in [(1, 1), (3, 2), (8, 3), (33, 2)]:  # 33: pyrt_moe_batch
        raw, w, x, ids, topk_w, bgu, bd = make_case(fmt, n_tokens, seed=n_tokens)
        xk = kernel_x(fmt, x)
        args = (w, xk, ids, topk_w, bgu.double(), bd.double())
        _, _, abs_act, _ = reference(*args)
        threshold = _threshold(abs_act) if sparse else None
        with cc.CpuCore(threads) as core:
            y, n_active = core.moe_ffn(
                raw, FORMATS[fmt], 5, 37, x.shape[1], x, ids, topk_w, "swiglu_oai", threshold,
                bias=(bgu, bd), swiglu=(ALPHA, LIMIT),
            )  # fmt: skip
        ref, ref_active, _, bound = reference(*args, threshold, threads)
        assert n_active == ref_active
        assert_within(y, ref, bound, f"{fmt} sparse={sparse} T={n_tokens} threads={threads}")


def test_clamps_and_biases_bind():
    """The inputs exercise what the test checks: clamped gates and ups, nonzero biases."""
    _, w, x, ids, topk_w, bgu, bd = make_case("F32", 8, seed=8)
    s = ids.long()
    g = torch.einsum("tkfd,td->tkf", w[s][..., 0, :], x.double()) + bgu.double()[s][..., 0]
    u = torch.einsum("tkfd,td->tkf", w[s][..., 1, :], x.double()) + bgu.double()[s][..., 1]
    assert 0.1 < (g > LIMIT).double().mean() < 0.5
    assert 0.1 < (u.abs() > LIMIT).double().mean() < 0.9


@pytest.mark.parametrize("fmt", ["F32", "Q8_0"])
def test_expert_map_indexes_biases_by_slot(cc, fmt):
    """Experts 1 and 3 held in slots 1 and 0 of a two-expert tensor (biases by slot too); the
    pairs of the other experts add nothing, not even their down bias."""
    raw, w, x, ids, topk_w, bgu, bd = make_case(fmt, 6, seed=3)
    per_expert = raw.reshape(5, 37 * 3, -1)  # raw: one row (elements or bytes) per neuron row
    held = torch.tensor([3, 1])
    slots_raw = per_expert[held.numpy()].reshape(-1, raw.shape[1]).copy()
    emap = torch.full((5,), -1, dtype=torch.int32)
    emap[held] = torch.arange(2, dtype=torch.int32)
    with cc.CpuCore(2) as core:
        y, _ = core.moe_ffn(
            slots_raw, FORMATS[fmt], 5, 37, x.shape[1], x, ids, topk_w, "swiglu_oai",
            expert_map=emap, bias=(bgu[held], bd[held]), swiglu=(ALPHA, LIMIT),
        )  # fmt: skip
    keep = (emap[ids.long()] >= 0).double()
    ref, _, _, bound = reference(
        w, kernel_x(fmt, x), ids, topk_w * keep, bgu.double(), bd.double(), threads=2
    )
    assert_within(y, ref, bound, f"{fmt} expert map")


def test_bias_shapes_are_checked(cc):
    raw, _, x, ids, topk_w, bgu, bd = make_case("F32", 2, seed=1)
    with cc.CpuCore(1) as core, pytest.raises(cc.CoreError, match="expert biases have shapes"):
        core.moe_ffn(raw, FORMATS["F32"], 5, 37, x.shape[1], x, ids, topk_w, "swiglu_oai",
                     bias=(bgu[:4], bd))  # fmt: skip
    with cc.CpuCore(1) as core, pytest.raises(cc.CoreError, match="limit > 0"):
        core.moe_ffn(raw, FORMATS["F32"], 5, 37, x.shape[1], x, ids, topk_w, "swiglu_oai",
                     swiglu=(1.702, 0.0))  # fmt: skip
