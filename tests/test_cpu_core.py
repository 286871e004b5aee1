"""The C core's MoE expert kernel (pyruntime.cpu.core, runtime/) against a plain PyTorch reference.

Every weight format x activation x token count x thread count x SIMD level available on this CPU,
dense and sparse, at odd shapes; invalid arguments; and the C unit tests under ASan + UBSan.

Tolerances (derived, not fitted). The reference is computed in float64 from exactly the numbers
the kernel reads: weights dequantized with gguf.quants.dequantize (exact in f32), and for Q8_0/Q4_0
the activation quantized to Q8_0 blocks the way the kernel does it (d = amax/127 in f32,
q = round-half-even(x * (1/d))), dequantized in float64. What is left is f32 rounding inside the
kernel, bounded by the standard dot-product bound |fl(a.b) - a.b| <= n u sum|a_i b_i| (u = 2^-24):
  gate/up:  |dg| <= eps_d * gabs,  gabs = sum_i |g_i x_i|,  eps_d = (n_embd + 2) u
  act:      |da| <= L |dg|,  L = max |act'| (SiLU 1.0998, GELU 1.129: L = 1.13 covers both)
  h=w a u:  |dh| <= w (L eps_d gabs |u| + |a| eps_d uabs) + 3 u |h|
  y:        |dy| <= sum_r |dh_r| |d_r| + eps_r sum_r |h_r d_r|,  eps_r = (K n_ff + threads + 2) u
That bound is rigorous to first order and far below any real bug (a dropped tail element or a
swapped nibble is an O(1) relative error). For the quantized formats a second check compares
with the unquantized activation, allowing for activation quantization: each x_i moves by at most
d_b / 2 (half a quantization step of its block), so |dg| <= sum_i |g_i| d_b(i) / 2 =: eg, and
|d(a u)| <= L eg (|u| + eu) + |a| eu, summed through the down rows like the rounding term.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_blocks import (
    K_QUANTS,
    q4_k_scales_codes,
    q6_k_scales_codes,
    quantize_x_q8k_ref,
    random_blocks,
)

from pyruntime.kernels.expert_formats import quantize_x_q8_ref

REPO = Path(__file__).resolve().parents[1]
U = 2.0**-24  # f32 unit roundoff
LIPSCHITZ = 1.13  # max |act'| over silu, gelu (tanh), gelu (erf)

Q = gguf.GGMLQuantizationType
FORMATS = {
    "F32": Q.F32,
    "F16": Q.F16,
    "BF16": Q.BF16,
    "Q8_0": Q.Q8_0,
    "Q4_0": Q.Q4_0,
    "MXFP4": Q.MXFP4,
    "Q5_0": Q.Q5_0,
    "Q5_1": Q.Q5_1,
    **K_QUANTS,
}
QUANTIZED = {"Q8_0", "Q4_0", "MXFP4", "Q5_0", "Q5_1", *K_QUANTS}
ACTS = {
    "silu": F.silu,
    "gelu": lambda g: F.gelu(g, approximate="tanh"),
    "gelu_exact": F.gelu,
}


# ---- library --------------------------------------------------------------------------------


def simd_levels() -> list[str]:
    from pyruntime.cpu import core as cpu_core

    try:
        best = cpu_core.SIMD_LEVELS[cpu_core.simd_best()]
    except cpu_core.CoreError:
        best = 0  # not built yet: the cc fixture builds it; scalar is always there
    return [name for name, value in cpu_core.SIMD_LEVELS.items() if value <= best]


# ---- inputs and reference -------------------------------------------------------------------


def make_weights(fmt: str, n_expert: int, n_ff: int, n_embd: int, gen: torch.Generator):
    """Random experts in layout [n_expert, n_ff, 3, n_embd]: (raw bytes as stored, f64 values)."""
    w = torch.randn(n_expert, n_ff, 3, n_embd, generator=gen) * n_embd**-0.5
    rows = w.reshape(-1, n_embd).numpy().astype(np.float32)
    if fmt in K_QUANTS:  # gguf-py has no K-quant quantizer: random blocks of that size
        rng = np.random.default_rng(int(torch.randint(2**31, (1,), generator=gen)))
        raw = random_blocks(FORMATS[fmt], rows.shape[0], n_embd, rng, scale=3 * n_embd**-0.5)
    else:
        raw = gguf.quants.quantize(rows, FORMATS[fmt])
    values = gguf.quants.dequantize(raw, FORMATS[fmt]).astype(np.float64)
    return np.ascontiguousarray(raw), torch.from_numpy(values).reshape(w.shape)


def block_half_step(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Largest change quantization makes to each x_i: half a step of its block (of `block`
    elements sharing one scale), d_b / 2."""
    t, n = x.shape
    d = x.reshape(t, n // block, block).abs().amax(dim=-1, keepdim=True).double() / 127.0
    return (d / 2).expand(t, n // block, block).reshape(t, n)


def reference(
    w, x, ids, topk_w, act, threshold=None, x_err=None, threads=1, here=None, down_i8=None
):
    """(y, n_active, per-(t,k,j) |act|, bound on |y_kernel - y|) in float64.

    w [E, F, 3, D] f64; x [T, D] f64; ids [T, K]; topk_w [T, K]. x_err: per-element bound on how
    far the kernel's x may be from this x (activation quantization), else only f32 rounding.
    here: None, or bool [E]: only the (token, expert) pairs of experts held here are computed.
    down_i8: None, or the K-quant down rows' (d sc_j [E, F, D / sub-block], codes [E, F, D])
    where the kernel folds each neuron's h into int8 multipliers (down_i8_error).
    """
    ws = w[ids.long()]  # [T, K, F, 3, D]
    g = torch.einsum("tkfd,td->tkf", ws[..., 0, :], x)
    u = torch.einsum("tkfd,td->tkf", ws[..., 1, :], x)
    a = ACTS[act](g)
    keep = torch.ones_like(a, dtype=torch.bool) if threshold is None else a.abs() >= threshold
    if here is not None:
        keep = keep & here[ids.long()][..., None]
    h = topk_w.double()[..., None] * a * u * keep
    y = torch.einsum("tkf,tkfd->td", h, ws[..., 2, :])

    n_embd, k, n_ff = x.shape[1], ids.shape[1], w.shape[1]
    xa = x.abs()
    gabs = torch.einsum("tkfd,td->tkf", ws[..., 0, :].abs(), xa)
    uabs = torch.einsum("tkfd,td->tkf", ws[..., 1, :].abs(), xa)
    eps_d = (n_embd + 2) * U
    eps_r = (k * n_ff + threads + 2) * U
    tw = topk_w.double().abs()[..., None]
    dh = tw * (LIPSCHITZ * eps_d * gabs * u.abs() + a.abs() * eps_d * uabs) + 3 * U * h.abs()
    if x_err is not None:
        eg = torch.einsum("tkfd,td->tkf", ws[..., 0, :].abs(), x_err)
        eu = torch.einsum("tkfd,td->tkf", ws[..., 1, :].abs(), x_err)
        dh = dh + tw * (LIPSCHITZ * eg * (u.abs() + eu) + a.abs() * eu)
    dabs = ws[..., 2, :].abs()
    bound = torch.einsum("tkf,tkfd->td", dh * keep, dabs) + eps_r * torch.einsum(
        "tkf,tkfd->td", h.abs(), dabs
    )
    if down_i8 is not None:
        bound = bound + down_i8_error(h.abs() + dh, keep, ids, *down_i8)
    return y, int(keep.sum()), a.abs(), bound


def down_i8_error(h_abs, keep, ids, dsc, codes):
    """Bound on what the int8 multipliers of K-quant down rows (pyrt_axpyn_i8_*) add to |dy|.

    A pass of up to 8 kept neurons of one route rounds each h_j d_j sc_j of sub-block s (Q4_K,
    Q5_K: 32 elements, Q6_K: 16; q the stored code, Q6_K's 0..63) to a
    multiple of S / 254, S = max |h_j d_j sc_j| / 127 over the pass: off by at most S / 508 (S /
    500 with the f32 rounding of the remainder), times the code q_ji. A pass's neurons are some
    of the route's, so with S_route = that max over all of the route's kept neurons: |dy_i| <=
    sum_routes (S_route(s(i)) / 500) sum_j q_ji. h_abs: |h| plus its bound (the kernel's h, from
    which it takes S, is within it)."""
    dsc, codes = dsc[ids.long()], codes[ids.long()]  # [T, K, F, D / 32], [T, K, F, D]
    s_route = ((h_abs * keep)[..., None] * dsc.abs()).amax(dim=2) / 127  # [T, K, sub-blocks]
    q_sum = torch.einsum("tkf,tkfd->tkd", keep.double(), codes)
    step = s_route.repeat_interleave(codes.shape[-1] // dsc.shape[-1], dim=-1) / 500
    return (step * q_sum).sum(dim=1)


def down_i8_of(fmt, simd, raw, n_expert, n_ff, n_embd):
    """The down rows' scales and codes where this level's kernel takes the int8 path (the
    K-quants on AVX-512: VNNI CPUs; the bound only widens where it does not), else None."""
    if fmt not in K_QUANTS or simd != "avx512":
        return None
    rows = np.asarray(raw).reshape(n_expert, n_ff, 3, -1)[:, :, 2].reshape(n_expert * n_ff, -1)
    if fmt == "Q6_K":
        dsc, codes = q6_k_scales_codes(rows, n_embd)
    else:
        dsc, codes = q4_k_scales_codes(rows, n_embd, q5=fmt == "Q5_K")
    shape = (n_expert, n_ff)
    return (
        torch.from_numpy(dsc).reshape(*shape, -1),
        torch.from_numpy(codes).double().reshape(*shape, -1),
    )


def default_n_embd(fmt: str) -> int:
    """3 blocks (an odd count) of the format; 83 = 2*32 + 16 + 3 for the float formats."""
    return 3 * 256 if fmt in K_QUANTS else 96 if fmt in QUANTIZED else 83


def make_case(fmt, n_tokens, seed, n_expert=5, n_ff=37, n_embd=None, k=3):
    gen = torch.Generator().manual_seed(seed)
    if n_embd is None:
        n_embd = default_n_embd(fmt)
    raw, w = make_weights(fmt, n_expert, n_ff, n_embd, gen)
    x = torch.randn(n_tokens, n_embd, generator=gen)
    ids = torch.stack([torch.randperm(n_expert, generator=gen)[:k] for _ in range(n_tokens)])
    topk_w = torch.rand(n_tokens, k, generator=gen)
    return raw, w, x, ids.to(torch.int32), topk_w, (n_expert, n_ff, n_embd)


def kernel_x(fmt, x):
    """x as the kernels of fmt read it: Q8 blocks (the K-quants': a scale per 256) or f32."""
    if fmt in K_QUANTS:
        return quantize_x_q8k_ref(x)
    return quantize_x_q8_ref(x) if fmt in QUANTIZED else x.double()


def assert_within(y, ref, bound, what):
    """|y - ref| <= bound elementwise (a bound of 0, a token with no pair here: exactly ref)."""
    err = (y.double() - ref).abs()
    worst = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.inf, 0.0)).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g} exceeds bound (ratio {worst:.3g})"


# ---- kernel vs reference --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("act", list(ACTS))
def test_dense_matches_reference(cc, simd, fmt, act):
    # 33 tokens: ~20 routes an expert, where the prefill's kernel runs (pyrt_moe_batch)
    for n_tokens, threads in [(1, 1), (3, 2), (8, 3), (33, 2)]:
        raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(fmt, n_tokens, seed=n_tokens)
        with cc.CpuCore(threads) as core:
            y, n_active = core.moe_ffn(
                raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, activation=act
            )
        assert y.shape == (n_tokens, n_embd) and y.dtype == torch.float32
        assert n_active == n_tokens * ids.shape[1] * n_ff
        i8 = down_i8_of(fmt, simd, raw, n_expert, n_ff, n_embd)
        ref, _, _, bound = reference(
            w, kernel_x(fmt, x), ids, topk_w, act, threads=threads, down_i8=i8
        )
        assert_within(y, ref, bound, f"{fmt} {act} T={n_tokens} threads={threads}")
        if fmt in QUANTIZED:  # against the unquantized activation, allowing for quantization
            ref, _, _, bound = reference(
                w,
                x.double(),
                ids,
                topk_w,
                act,
                x_err=block_half_step(x, 256 if fmt in K_QUANTS else 32),
                threads=threads,
                down_i8=i8,
            )
            assert_within(y, ref, bound, f"{fmt} {act} vs float x")


# n_ff 211: a work item spans several chunks of 32 neurons, so the software-pipelined sparse
# path (gates of one chunk while the previous chunk's up/down rows are fetched) runs.
@pytest.mark.parametrize("n_ff", [37, 211])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sparse_drops_exactly_the_neurons_under_threshold(cc, simd, fmt, n_ff):
    for n_tokens, threads in [(1, 2), (3, 3), (8, 2), (33, 3)]:
        raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(
            fmt, n_tokens, seed=7, n_ff=n_ff
        )
        xk = kernel_x(fmt, x)
        _, _, abs_act, _ = reference(w, xk, ids, topk_w, "silu")
        # A threshold in the widest gap between sorted |act| values around the 60% quantile, so
        # no |act| is near it: the kernel's f32 |act| (relative error ~1e-6) falls on the same
        # side as the reference's.
        vals = abs_act.flatten().sort().values
        lo, hi = int(0.5 * len(vals)), int(0.7 * len(vals))
        gaps = vals[lo + 1 : hi + 1] - vals[lo:hi]
        i = lo + int(gaps.argmax())
        threshold = float((vals[i] + vals[i + 1]) / 2)
        assert (vals[i + 1] - vals[i]) > 1e-4 * threshold, "inputs give no clean threshold"
        with cc.CpuCore(threads) as core:
            y, n_active = core.moe_ffn(
                raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, threshold=threshold
            )
        i8 = down_i8_of(fmt, simd, raw, n_expert, n_ff, n_embd)
        ref, ref_active, _, bound = reference(
            w, xk, ids, topk_w, "silu", threshold, None, threads, down_i8=i8
        )
        assert n_active == ref_active == int((abs_act >= threshold).sum())
        assert 0 < n_active < n_tokens * ids.shape[1] * n_ff
        assert_within(y, ref, bound, f"sparse {fmt} T={n_tokens}")


# One token: every chunk has one route (the decode step's path: up rows two per pass, down rows
# queued across chunks); 8 tokens: chunks of several routes too.
@pytest.mark.parametrize("n_tokens", [1, 8])
@pytest.mark.parametrize("n_ff", [37, 211])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sparse_that_drops_nothing_equals_dense_bitwise(cc, simd, fmt, n_ff, n_tokens):
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(fmt, n_tokens, seed=11, n_ff=n_ff)
    _, _, abs_act, _ = reference(w, kernel_x(fmt, x), ids, topk_w, "silu")
    threshold = float(abs_act.min()) / 2  # > 0: the sparse branch runs, but keeps every neuron
    with cc.CpuCore(2) as core:
        dense, n_dense = core.moe_ffn(raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w)
        sparse, n_sparse = core.moe_ffn(
            raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, threshold=threshold
        )
        zero, _ = core.moe_ffn(
            raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, threshold=0.0
        )
    assert n_sparse == n_dense == n_tokens * 3 * n_ff
    assert torch.equal(sparse, dense) and torch.equal(zero, dense)


# 19 blocks: two groups of 8 (AVX-512: block scales converted 8 at a time), a pair step, the odd
# last block; the other tests' n_embd of 96 (3 blocks) never reaches a group of 8. (The K-quant
# kernels walk super-blocks one at a time: 3 of them are every path.)
@pytest.mark.parametrize("fmt", sorted(QUANTIZED - set(K_QUANTS)))
def test_quantized_rows_of_19_blocks(cc, simd, fmt):
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(
        fmt, 8, seed=13, n_ff=40, n_embd=19 * 32
    )
    _, _, abs_act, _ = reference(w, kernel_x(fmt, x), ids, topk_w, "silu")
    vals = abs_act.flatten().sort().values  # threshold in the widest gap around the median
    lo, hi = int(0.4 * len(vals)), int(0.6 * len(vals))
    i = lo + int((vals[lo + 1 : hi + 1] - vals[lo:hi]).argmax())
    threshold = float((vals[i] + vals[i + 1]) / 2)
    with cc.CpuCore(3) as core:
        for t in (0.0, threshold):
            y, _ = core.moe_ffn(
                raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, threshold=t
            )
            ref, _, _, bound = reference(
                w, kernel_x(fmt, x), ids, topk_w, "silu", t or None, threads=3
            )
            assert_within(y, ref, bound, f"{fmt} 19 blocks threshold {t:.3g}")


def test_many_tokens_span_token_blocks_and_int64_ids(cc):
    """More tokens than one token block (64), repeated experts across tokens, int64 ids."""
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(
        "Q8_0", 70, seed=3, n_expert=4, n_ff=9, n_embd=64, k=2
    )
    with cc.CpuCore(2) as core:
        y, n_active = core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids.long(), topk_w)
    ref, _, _, bound = reference(w, quantize_x_q8_ref(x), ids, topk_w, "silu", threads=2)
    assert n_active == 70 * 2 * 9
    assert_within(y, ref, bound, "70 tokens")


def test_reads_a_gguf_reader_tensor_in_place(cc, tmp_path):
    """The weights come straight from gguf.GGUFReader's mmap view (no copy)."""
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q4_0", 3, seed=5)
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "olmoe")
    writer.add_tensor(
        "blk.0.ffn_gud_exps.weight",
        raw.reshape(n_expert, n_ff, 3, -1),  # bytes; the header gets [.., n_embd] from raw_dtype
        raw_dtype=Q.Q4_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(tmp_path / "t.gguf").tensors[0]
    assert not tensor.data.flags.owndata  # a view of the mmap
    with cc.CpuCore(2) as core:
        y, _ = core.moe_ffn(
            tensor.data, int(tensor.tensor_type), n_expert, n_ff, n_embd, x, ids, topk_w
        )
    ref, _, _, bound = reference(w, quantize_x_q8_ref(x), ids, topk_w, "silu", threads=2)
    assert_within(y, ref, bound, "from GGUFReader")


def test_out_receives_y(cc):
    """out=: y is written into the caller's tensor (same bits as a fresh one); a tensor of the
    wrong shape, dtype or layout, or one that shares memory with x, is refused."""
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 3, seed=5)
    with cc.CpuCore(2) as core:
        y, n = core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w)
        out = torch.full((3, n_embd), float("nan"))
        y2, n2 = core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, out=out)
        assert y2 is out and n2 == n and torch.equal(out, y)
        bad = [
            torch.empty(2, n_embd),
            torch.empty(3, n_embd, dtype=torch.float64),
            torch.empty(n_embd, 3).t(),
            torch.zeros(3, n_embd).to_sparse(),
        ]
        for b in bad:
            with pytest.raises(cc.CoreError, match="out must be"):
                core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, out=b)
        x32 = x.float().contiguous()  # x itself reaches the kernel (no copy): y would overwrite it
        with pytest.raises(cc.CoreError, match="share memory with x"):
            core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x32, ids, topk_w, out=x32)


# ---- expert maps ----------------------------------------------------------------------------


def slots_of(raw: np.ndarray, n_expert: int, experts: list[int]) -> np.ndarray:
    """A compact weights tensor holding `experts` in that order (slot s: experts[s])."""
    per_expert = raw.reshape(n_expert, -1)
    return np.ascontiguousarray(per_expert[experts].reshape(-1, *raw.shape[1:]))


@pytest.mark.parametrize("n_tokens", [6, 33])  # 33: the prefill's kernel (pyrt_moe_batch)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_expert_map_computes_the_pairs_held_here(cc, fmt, n_tokens):
    """expert_map (id -> slot, -1 = elsewhere): a compact tensor of experts 4, 0, 2 in that slot
    order gives the reference over those experts' pairs only, n_active counting only them (dense
    and sparse); a map over the full tensor keeping the other experts gives theirs; and the two
    complementary results sum to the unmapped y.

    Tolerance of the sum: each result is within its derived bound (module docstring) of its
    float64 reference, and the two references sum to the full one exactly in real arithmetic
    (each pair's term is in exactly one of them), so |y_a + y_b - y| <= bound_a + bound_b +
    bound + u |y_a + y_b| (the last term: the f32 addition here). Not bit-exact: the maps change
    which experts share a work item, hence the order of the f32 sums."""
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(fmt, n_tokens, seed=21, n_ff=45)
    xk = kernel_x(fmt, x)
    held = [4, 0, 2]
    map_a = torch.full((n_expert,), -1, dtype=torch.int32)
    for slot, e in enumerate(held):
        map_a[e] = slot
    here_a = map_a >= 0
    map_b = torch.where(here_a, -1, torch.arange(n_expert, dtype=torch.int32))
    compact = slots_of(raw, n_expert, held)
    _, _, abs_act, _ = reference(w, xk, ids, topk_w, "silu")
    vals = abs_act.flatten().sort().values  # threshold in the widest gap around the median
    lo, hi = int(0.4 * len(vals)), int(0.6 * len(vals))
    i = lo + int((vals[lo + 1 : hi + 1] - vals[lo:hi]).argmax())
    with cc.CpuCore(3) as core:
        for threshold in (None, float((vals[i] + vals[i + 1]) / 2)):
            call = dict(activation="silu", threshold=threshold)
            y, n = core.moe_ffn(raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, **call)
            y_a, n_a = core.moe_ffn(
                compact, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, **call,
                expert_map=map_a,
            )  # fmt: skip
            y_b, n_b = core.moe_ffn(
                raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w, **call,
                expert_map=map_b,
            )  # fmt: skip
            i8 = down_i8_of(fmt, cc.simd_best(), raw, n_expert, n_ff, n_embd)
            ref, _, _, bound = reference(
                w, xk, ids, topk_w, "silu", threshold, threads=3, down_i8=i8
            )
            ref_a, act_a, _, bound_a = reference(
                w, xk, ids, topk_w, "silu", threshold, threads=3, here=here_a, down_i8=i8
            )
            ref_b, act_b, _, bound_b = reference(
                w, xk, ids, topk_w, "silu", threshold, threads=3, here=~here_a, down_i8=i8
            )
            what = f"{fmt} threshold {threshold}"
            assert_within(y_a, ref_a, bound_a, f"compact permuted slots, {what}")
            assert_within(y_b, ref_b, bound_b, f"masking map, {what}")
            assert (n_a, n_b) == (act_a, act_b) and n_a + n_b == n
            if threshold is None:
                assert n_a == int(here_a[ids.long()].sum()) * n_ff
            total = y_a.double() + y_b.double()
            assert_within(total, y.double(), bound_a + bound_b + bound + U * total.abs(), what)


def test_expert_map_edges_and_errors(cc):
    """A map of -1 only: y = 0 exactly and nothing computed; a map's length, its values (checked
    where a pair uses them) and a tensor that is not a whole number of experts are refused."""
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 3, seed=22)
    none = torch.full((n_expert,), -1, dtype=torch.int32)
    with cc.CpuCore(2) as core:
        y, n = core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, expert_map=none)
        assert n == 0 and torch.equal(y, torch.zeros_like(y))
        compact = slots_of(raw, n_expert, [1, 3])
        bad = torch.full((n_expert,), -1, dtype=torch.int32)
        bad[ids[0, 0]] = 2  # slot 2 of a tensor of 2
        with pytest.raises(
            cc.CoreError, match=r"expert_map\[\d\] = 2 is outside \[-1, n_slots=2\)"
        ):
            core.moe_ffn(compact, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, expert_map=bad)
        with pytest.raises(cc.CoreError, match="expert_map has shape"):
            core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, expert_map=bad[:3])
        with pytest.raises(cc.CoreError, match="not a whole number of experts"):
            core.moe_ffn(raw[:-1], Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, expert_map=none)


def test_bound_call_reads_its_buffers_at_each_call(cc):
    """bind_moe: the bound call gives moe_ffn's y and n_active bit for bit, on what x, the ids,
    the weights and the expert map hold when it is called (written in place after binding);
    tensors moe_ffn would convert (so the call could not see later writes), no tokens, and a
    closed core are refused."""
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 1, seed=23)
    x, ids, topk_w = x.float().contiguous(), ids.to(torch.int32), topk_w.float().contiguous()
    emap = torch.full((n_expert,), -1, dtype=torch.int32)
    out = torch.empty(1, n_embd)
    gen = torch.Generator().manual_seed(24)
    with cc.CpuCore(2) as core:
        call = core.bind_moe(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, out, emap)
        for step in range(3):
            x.copy_(torch.randn(x.shape, generator=gen))
            ids.copy_(torch.randperm(n_expert, generator=gen)[: ids.shape[1]])
            topk_w.copy_(torch.rand(topk_w.shape, generator=gen))
            held = ids[0, : step + 1]
            emap.fill_(-1)
            emap[held.long()] = held
            n = call()
            want, n_want = core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w,
                                        expert_map=emap.clone())  # fmt: skip
            assert n == n_want == (step + 1) * n_ff and torch.equal(out, want)
        converted = {"topk_ids": ids.long(), "x": x.double(), "expert_map": emap.long()}
        for name, bad in converted.items():
            args = {**dict(x=x, topk_ids=ids, topk_w=topk_w, out=out, expert_map=emap), name: bad}
            with pytest.raises(cc.CoreError, match=f"{name} to bind must be"):
                core.bind_moe(raw, Q.Q8_0, n_expert, n_ff, n_embd, **args)
        with pytest.raises(cc.CoreError, match="at least one token"):
            core.bind_moe(raw, Q.Q8_0, n_expert, n_ff, n_embd, x[:0], ids[:0], topk_w[:0],
                          out[:0])  # fmt: skip
    with pytest.raises(cc.CoreError, match="closed"):
        call()


def play_graph(flags: torch.Tensor, routing, n_expert: int, out: torch.Tensor, seq: int,
               ys: list, gen: torch.Generator) -> None:  # fmt: skip
    """The GPU graph's side of a hybrid decode step, played by a thread: for each MoE layer,
    write a routing (x, ids, weights, codes 0 / 1 / 2) into the host buffers, raise the first
    flag, wait for the host's (10 s at most) and keep what it wrote."""
    x, ids, w, codes = routing
    deadline = time.monotonic() + 10.0
    for m in range(flags.shape[1]):
        x.copy_(torch.randn(x.shape, generator=gen))
        ids.copy_(torch.randperm(n_expert, generator=gen)[: ids.shape[1]])
        w.copy_(torch.rand(w.shape, generator=gen))
        codes.copy_(torch.randint(0, 3, codes.shape, generator=gen))
        ys.append((x.clone(), ids.clone(), w.clone(), codes.clone()))
        flags[0, m] = seq
        while int(flags[1, m]) != seq:
            if time.monotonic() > deadline:
                return
        ys[-1] += (out.clone(),)


@pytest.mark.parametrize("threshold", [None, 0.05])
def test_host_step_takes_turns_with_a_graph(cc, threshold):
    """bind_host_step: for each layer in turn the host waits for the graph's flag, computes the
    pairs coded 2 on that layer's experts (moe_ffn's y and n_active bit for bit, 0 where none is
    coded 2), raises its own flag; the routing is logged as read. A graph that never signals is
    a timeout naming the layer, the layers before it answered; a threshold moe_ffn would refuse
    is refused before any layer runs; a tensor the call could not read in place is refused."""
    cases = [make_case("Q8_0", 1, seed=30 + m) for m in range(3)]
    _, _, x, ids, w, (n_expert, n_ff, n_embd) = cases[0]
    x, ids, w = x.contiguous(), ids.contiguous(), w.contiguous()
    codes = torch.zeros_like(ids)
    out, flags = torch.empty(1, n_embd), torch.zeros(2, 3, dtype=torch.int32)
    logits = torch.randn(1, n_expert)
    layers = [(c[0], threshold, None) for c in cases]
    gen = torch.Generator().manual_seed(34)
    with cc.CpuCore(2) as core:
        step = core.bind_host_step(layers, Q.Q8_0, n_expert, n_ff, n_embd, (x, ids, w, codes),
                                   out, flags, 2, logits=logits, timeout_s=5.0)  # fmt: skip
        for seq in (1, 2):
            seen: list = []
            graph = threading.Thread(target=play_graph, args=(flags, (x, ids, w, codes),
                                     n_expert, out, seq, seen, gen))  # fmt: skip
            graph.start()
            waited, computed = step(seq)
            graph.join()
            assert waited >= 0 and computed > 0 and flags[1].tolist() == [seq] * 3
            assert len(seen) == 3 and all(len(turn) == 5 for turn in seen)
            for m, (xm, idm, wm, cm, y) in enumerate(seen):
                emap = torch.where(cm[0] == 2, idm[0], -1)
                full = torch.full((n_expert,), -1, dtype=torch.int32)
                full[idm[0].long()] = emap.to(torch.int32)
                want, n_want = core.moe_ffn(cases[m][0], Q.Q8_0, n_expert, n_ff, n_embd, xm, idm,
                                            wm, expert_map=full, threshold=threshold)  # fmt: skip
                assert torch.equal(y, want) and step.n_active[m] == n_want, m
                assert (step.ids_log[m] == idm[0].numpy()).all()
                assert (step.codes_log[m] == cm[0].numpy()).all()
                assert (step.logits_log[m] == logits[0].numpy()).all()
        short = core.bind_host_step(layers, Q.Q8_0, n_expert, n_ff, n_embd, (x, ids, w, codes),
                                    out, flags, 2, timeout_s=0.05)  # fmt: skip
        flags[0, 0] = 3
        with pytest.raises(cc.CoreError, match="did not reach MoE layer 1"):
            short(3)
        assert flags[1].tolist() == [3, 2, 2]
        bad = [layers[0], (cases[1][0], float("inf"), None), layers[2]]
        refused = core.bind_host_step(bad, Q.Q8_0, n_expert, n_ff, n_embd, (x, ids, w, codes),
                                      out, flags, 2, timeout_s=0.05)  # fmt: skip
        with pytest.raises(cc.CoreError, match="layer 1's threshold must be finite"):
            refused(4)  # before any layer runs: no flag of step 4 raised
        assert flags[1].tolist() == [3, 2, 2]
        with pytest.raises(cc.CoreError, match="codes to bind must be"):
            core.bind_host_step(layers, Q.Q8_0, n_expert, n_ff, n_embd,
                                (x, ids, w, codes.long()), out, flags, 2)  # fmt: skip


def test_zero_tokens(cc):
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("F32", 1, seed=1)
    with cc.CpuCore(1) as core:
        y, n = core.moe_ffn(raw, Q.F32, n_expert, n_ff, n_embd, x[:0], ids[:0], topk_w[:0])
    assert y.shape == (0, n_embd) and n == 0


# ---- errors ---------------------------------------------------------------------------------


def test_invalid_arguments_raise_with_the_c_message(cc):
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 2, seed=2)
    with cc.CpuCore(2) as core:

        def call(**kw):
            args = dict(
                gud=raw,
                fmt=Q.Q8_0,
                n_expert=n_expert,
                n_ff=n_ff,
                n_embd=n_embd,
                x=x,
                topk_ids=ids,
                topk_w=topk_w,
            )
            args.update(kw)
            return core.moe_ffn(**args)

        cases = [
            (dict(fmt=3), "unknown weight format 3"),
            (dict(n_expert=n_expert + 1), "weights hold"),
            (dict(n_ff=0), "sizes must be positive"),
            (dict(fmt=Q.F32), "weights hold"),
            (dict(topk_ids=ids.clone().fill_(n_expert)), "outside [0, n_expert=5)"),
            (dict(topk_ids=ids.clone().fill_(-1)), "outside"),
            (dict(threshold=-0.5), "threshold must be finite and >= 0"),
            (dict(threshold=float("nan")), "threshold must be finite"),
            (dict(activation="relu"), "unknown expert activation"),
            (dict(x=x[:, :32], n_embd=32), "weights hold"),
            (dict(x=x[:1]), "shape mismatch"),
            (dict(x=x.int()), "dtype"),
            (dict(gud=raw[:, ::2]), "C-contiguous"),
        ]
        for kw, message in cases:
            with pytest.raises(cc.CoreError) as info:
                call(**kw)
            assert message in str(info.value), (kw, str(info.value))
        # n_embd not a multiple of the Q8_0 block
        with pytest.raises(cc.CoreError, match="not a multiple of 32"):
            call(x=torch.randn(2, 40), n_embd=40)
    with pytest.raises(cc.CoreError, match="closed"):
        core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w)
    assert issubclass(cc.CoreError, __import__("pyruntime.errors").errors.PyruntimeError)


def test_zero_threads_and_null_pointers(cc):
    with pytest.raises(cc.CoreError, match=r"n_threads must be in \[1, 1024\], got 0"):
        cc.CpuCore(0)
    lib, ffi = cc._lib(), cc._ffi
    out = ffi.new("pyrt_pool **")
    assert lib.pyrt_pool_create(1, ffi.NULL, out) == lib.PYRT_OK
    pool = out[0]
    try:
        y = ffi.new("float[32]")
        xs = ffi.new("float[32]")
        ids = ffi.new("int32_t[1]")
        tw = ffi.new("float[1]")
        w = ffi.new("float[96]")
        experts = ffi.new("pyrt_experts *", (w, 384, 0, 1, 1, 1, 32, ffi.NULL))
        rc = lib.pyrt_moe_ffn(ffi.NULL, experts, xs, 1, ids, tw, 1, 0, 0.0, y, ffi.NULL)
        assert rc == lib.PYRT_E_INVALID and b"pool is NULL" in ffi.string(lib.pyrt_last_error())
        rc = lib.pyrt_moe_ffn(pool, ffi.NULL, xs, 1, ids, tw, 1, 0, 0.0, y, ffi.NULL)
        assert rc == lib.PYRT_E_INVALID and b"experts is NULL" in ffi.string(lib.pyrt_last_error())
        experts.data = ffi.NULL
        rc = lib.pyrt_moe_ffn(pool, experts, xs, 1, ids, tw, 1, 0, 0.0, y, ffi.NULL)
        assert rc == lib.PYRT_E_INVALID and b"data" in ffi.string(lib.pyrt_last_error())
        experts.data = w
        rc = lib.pyrt_moe_ffn(pool, experts, ffi.NULL, 1, ids, tw, 1, 0, 0.0, y, ffi.NULL)
        assert rc == lib.PYRT_E_INVALID and b"x is NULL" in ffi.string(lib.pyrt_last_error())
        rc = lib.pyrt_moe_ffn(pool, experts, xs, 1, ids, tw, 1, 0, 0.0, y, ffi.NULL)
        assert rc == lib.PYRT_OK, ffi.string(lib.pyrt_last_error())
        assert lib.pyrt_pool_create(1, ffi.NULL, ffi.NULL) == lib.PYRT_E_INVALID
    finally:
        lib.pyrt_pool_free(pool)


def test_params_change_speed_not_results(cc):
    """A pool's params (prefetch distances, VNNI, spin) give the default pool's bits; a name or
    value the C core does not take is refused with what and where."""
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 3, seed=4, n_ff=211)
    defaults = cc.default_params()
    assert defaults["expert_prefetch_neurons"] == -1 and defaults["fuse_layer"] == 1  # -1: auto
    with cc.CpuCore(2) as core:
        assert core.params == defaults
        want, n_want = core.moe_ffn(
            raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, "silu", 0.1
        )
    other = {"expert_prefetch_neurons": 0, "reduce_prefetch_items": 7, "vnni": 0, "spin_us": 0,
             "prefetch_l2": 1, "matvec_prefetch_rows": 9}  # fmt: skip
    with cc.CpuCore(2, params=other) as core:
        assert core.params == {**defaults, **other}
        got, n_got = core.moe_ffn(raw, Q.Q8_0, n_expert, n_ff, n_embd, x, ids, topk_w, "silu", 0.1)
    assert n_got == n_want and torch.equal(got, want)
    with pytest.raises(cc.CoreError, match="unknown C core parameter 'prefetch'"):
        cc.CpuCore(1, params={"prefetch": 1})
    with pytest.raises(cc.CoreError, match=r"params.fuse_router = 3 is outside \[0, 1\]"):
        cc.CpuCore(1, params={"fuse_router": 3})
    with pytest.raises(cc.CoreError, match="must be an integer"):
        cc.CpuCore(1, params={"spin_us": 1.5})


def test_helpers(cc):
    assert 1 <= cc.physical_cores() <= (os.cpu_count() or 1)
    assert cc.simd_level() in cc.SIMD_LEVELS
    assert cc.row_bytes(Q.Q8_0, 2048) == 2048 // 32 * 34
    assert cc.row_bytes(Q.Q4_0, 2048) == 2048 // 32 * 18
    assert cc.row_bytes(Q.Q5_1, 64) == 2 * 24 and cc.row_bytes(Q.Q6_K, 512) == 2 * 210
    assert cc.row_bytes(Q.Q8_0, 40) == 0 and cc.row_bytes(Q.Q4_K, 480) == 0
    assert cc.row_bytes(3, 64) == 0  # Q4_1: not read
    with pytest.raises(cc.CoreError, match="unknown SIMD level"):
        cc.force_simd("neon")
    core = cc.CpuCore()
    assert core.threads == cc.physical_cores()
    core.close()
    core.close()  # idempotent


def test_formats_table_is_the_headers_enum(cc):
    """core.FORMATS names every PYRT_FMT_* of pyrt.h, each the gguf type number of that name."""
    import re

    header = (REPO / "runtime" / "include" / "pyrt.h").read_text()
    enum = {int(v): k for k, v in re.findall(r"PYRT_FMT_(\w+) = (\d+)", header)}
    assert enum and cc.FORMATS == enum
    assert all(Q[name] == fmt for fmt, name in cc.FORMATS.items())
    for fmt, name in cc.FORMATS.items():  # every one a format the row kernels read
        assert cc.row_bytes(fmt, 256) > 0, name


def test_binding_declarations_come_from_the_header(cc, tmp_path, monkeypatch):
    """The binding declares the library from pyrt.h's PYRT_CDEF section: the section parses as
    cffi takes it, every function it declares resolves in the loaded library, the header beside
    a library comes first, and a missing header is a CoreError naming where it looked."""
    from cffi import FFI

    lib = cc._lib()
    header = REPO / "runtime" / "include" / "pyrt.h"
    section = cc.cdef_section(header)
    assert "pyrt_decoder_step" in section and "#" not in section  # no preprocessor lines
    ffi = FFI()
    ffi.cdef(section)
    functions = [n for n in dir(lib) if n.startswith("pyrt_")]
    assert len(functions) >= 15 and "pyrt_moe_ffn" in functions
    for name in functions:
        assert callable(getattr(lib, name)), name
    # a fresh FFI over the same section reaches the same library
    fresh = ffi.dlopen(str(next(p for p in cc._candidate_paths() if p.is_file())))
    assert fresh.pyrt_row_bytes(fresh.PYRT_FMT_Q8_0, 64) == 68

    # a library built from another API version than its declarations is refused
    assert lib.pyrt_api_version() == lib.PYRT_API_VERSION
    older = FFI()
    older.cdef(section.replace("PYRT_API_VERSION = ", "PYRT_API_VERSION = 1 + "))
    stale = older.dlopen(str(next(p for p in cc._candidate_paths() if p.is_file())))
    with pytest.raises(cc.CoreError, match=r"built from API version \d+ but .* declares version"):
        cc._check_api(stale, Path("libpyrt.so"), header)

    beside = tmp_path / "pyrt.h"
    assert cc.find_header(tmp_path / "libpyrt.so") == header  # none beside: the source tree's
    beside.write_text(header.read_text())
    assert cc.find_header(tmp_path / "libpyrt.so") == beside
    beside.unlink()
    monkeypatch.setattr(cc, "_SOURCE_HEADER", tmp_path / "src" / "pyrt.h")
    with pytest.raises(cc.CoreError, match=r"pyrt.h not found .* \(tried .*/pyrt.h, .*src/pyrt.h"):
        cc.find_header(tmp_path / "libpyrt.so")
    beside.write_text("/* no section */")
    with pytest.raises(cc.CoreError, match="has no /\\* PYRT_CDEF_BEGIN"):
        cc.cdef_section(beside)


# ---- C unit tests under sanitizers ----------------------------------------------------------


def test_c_unit_tests_under_asan_ubsan(tmp_path):
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler")
    sources = [
        *sorted((REPO / "runtime" / "src").glob("*.c")),
        REPO / "tests" / "c" / "test_core.c",
    ]
    exe = tmp_path / "test_core"
    cmd = [
        compiler,
        "-std=c11",
        "-O1",
        "-g",
        "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{REPO / 'runtime' / 'include'}",
        f"-I{REPO / 'runtime' / 'src'}",
        *map(str, sources),
        "-o",
        str(exe),
        "-pthread",
        "-lm",
    ]
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr and "unrecognized" in build.stderr:
        pytest.skip(f"{compiler} has no ASan/UBSan")
    assert build.returncode == 0, build.stderr
    run = subprocess.run(
        [str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all C core tests passed" in run.stdout
