"""Expert maps (kernels.moe_args) on every routed-expert path: a global expert id -> a slot of a
compact expert tensor, -1 = "not on this device" (the pair adds nothing and counts 0 active).

Each path runs twice on complementary maps, each over a compact tensor of its experts in a
permuted slot order; each result must equal the torch reference on the full expert tensor with
the other experts' routing weights zeroed, and the two must add up to the unmapped result."""

import pytest
import torch

from pyruntime.kernels.dispatch import moe_experts
from pyruntime.kernels.expert_formats import quantize_x_q8_ref
from pyruntime.kernels.expert_paths import (
    DENSE_PATHS,
    Q4R_PATHS,
    Q8R_PATHS,
    SPARSE_PATHS,
    SparseSwitch,
    quantizes_x,
)
from pyruntime.kernels.moe_dense import moe_dense, moe_dense_ref
from pyruntime.kernels.moe_sparse import moe_gate, moe_gate_ref, moe_sparse, moe_sparse_ref
from pyruntime.kernels.testing import (
    DEVICE,
    N_EXPERT,
    Q8R_N_EMBD,
    assert_close_rel,
    gap_threshold,
    make_case,
    rtol_for,
)

FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q8_0r", "q4_0r", "mxfp4r"]
GENERIC_DENSE = [p for p in DENSE_PATHS if p not in Q8R_PATHS]
GENERIC_SPARSE = [p for p in SPARSE_PATHS if p not in Q8R_PATHS]
# experts on "this device" in the first map, in slot order (a permutation); the rest in the other
SLOTS_A = [3, 0, 2]
SLOTS_B = [5, 1, 4]


def compact(w: torch.Tensor, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts' rows stacked in slot order, the expert map [N_EXPERT] int32)."""
    emap = torch.full((N_EXPERT,), -1, dtype=torch.int32)
    emap[experts] = torch.arange(len(experts), dtype=torch.int32)
    return w[experts].contiguous(), emap.to(w.device)


def on_device(ids: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """[T, K] bool: whether each pair's expert is among `experts`."""
    return torch.isin(ids.long(), torch.tensor(experts, device=ids.device))


def case(fmt: str, n_tok: int, seed: int):
    n_embd = Q8R_N_EMBD if fmt == "q8_0r" else None
    x, w, ids, tw = make_case(fmt, n_tok, torch.bfloat16, seed=seed, n_embd=n_embd)
    assert on_device(ids, SLOTS_A).any() and on_device(ids, SLOTS_B).any()
    return x, w, ids, tw


# Relative tolerance of a path's result vs the torch reference: bf16 x runs on bf16 tensor cores
# on a GPU (kernels.testing.rtol_for); fp32 summation-order rounding only, elsewhere.
RTOL = rtol_for(torch.bfloat16)


def q8_x(path: str) -> bool:
    return quantizes_x(path)


def path_formats(path: str, formats: list[str]) -> list[str]:
    """The formats a path takes: the q8r kernels q8_0r, q4r_pipe the 4-bit repacked ones."""
    if path in Q8R_PATHS:
        return ["q8_0r"]
    return ["q4_0r", "mxfp4r"] if path in Q4R_PATHS else formats


def params(paths, formats):
    return [(p, f) for p in paths for f in path_formats(path=p, formats=formats)]


@pytest.mark.parametrize(("path", "fmt"), params(DENSE_PATHS, FORMATS))
def test_dense_complementary_maps_add_up(path, fmt):
    n_tok = 1 if path in ("q8r_pipe", "q4r_pipe") else 3  # at 1: x quantized in the kernel
    x, w, ids, tw = case(fmt, n_tok, seed=100 + len(path))
    full = moe_dense_ref(x, w, fmt, ids, tw, q8_x=q8_x(path))
    total = torch.zeros_like(full)
    for experts in (SLOTS_A, SLOTS_B):
        ws, emap = compact(w, experts)
        y = moe_dense(x, ws, fmt, ids, tw, path=path, expert_map=emap)
        ref = moe_dense_ref(x, w, fmt, ids, tw * on_device(ids, experts), q8_x=q8_x(path))
        assert_close_rel(y, ref, RTOL)
        assert_close_rel(
            y, moe_dense_ref(x, ws, fmt, ids, tw, q8_x=q8_x(path), expert_map=emap), RTOL
        )
        total += y
    assert_close_rel(total, full, RTOL)


@pytest.mark.parametrize(("path", "fmt"), params(SPARSE_PATHS, FORMATS))
def test_sparse_complementary_maps_add_up_and_count_computed_pairs(path, fmt):
    n_tok = 1 if path == "q8r_sparse2" else 3  # q8r_sparse2 at 1: x quantized in the kernel
    x, w, ids, tw = case(fmt, n_tok, seed=200 + len(path))
    xg = quantize_x_q8_ref(x) if q8_x(path) else x
    thr = gap_threshold(moe_gate_ref(xg, w, fmt, ids), "silu", 0.5)
    full, full_active = moe_sparse_ref(x, w, fmt, ids, tw, thr, q8_x=q8_x(path))
    assert 0 < int(full_active.sum()) < full_active.numel() * w.shape[1]
    total = torch.zeros_like(full)
    total_active = torch.zeros_like(full_active)
    for experts in (SLOTS_A, SLOTS_B):
        ws, emap = compact(w, experts)
        y, active = moe_sparse(x, ws, fmt, ids, tw, thr, path=path, expert_map=emap)
        here = on_device(ids, experts)
        ref, _ = moe_sparse_ref(x, w, fmt, ids, tw * here, thr, q8_x=q8_x(path))
        assert_close_rel(y, ref, RTOL)
        assert torch.equal(active, torch.where(here, full_active, 0))  # only computed pairs
        total += y
        total_active += active
    assert_close_rel(total, full, RTOL)
    assert torch.equal(total_active, full_active)


@pytest.mark.parametrize("path", DENSE_PATHS + SPARSE_PATHS)
def test_no_expert_on_the_device_adds_nothing(path):
    fmt = path_formats(path, ["q4_0"])[0]
    x, w, ids, tw = case(fmt, 3, seed=300)
    emap = torch.full((N_EXPERT,), -1, dtype=torch.int32, device=DEVICE)
    slots = w[:2].contiguous()  # the tensor is never read
    if path in DENSE_PATHS:
        y = moe_dense(x, slots, fmt, ids, tw, path=path, expert_map=emap)
    else:
        y, active = moe_sparse(x, slots, fmt, ids, tw, 0.0, path=path, expert_map=emap)
        assert (active == 0).all()
    assert y.shape == x.shape and (y == 0).all()


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_gate_rows_of_pairs_not_on_the_device_are_zero(path):
    x, w, ids, tw = case("q8_0", 3, seed=400)
    ws, emap = compact(w, SLOTS_A)
    gate = moe_gate(x, ws, "q8_0", ids, path=path, expert_map=emap)
    here = on_device(ids, SLOTS_A).reshape(-1, 1)
    ref = torch.where(here, moe_gate_ref(x, w, "q8_0", ids), 0.0)
    assert_close_rel(gate, ref, RTOL)
    assert (gate[~here[:, 0]] == 0).all()


def test_moe_experts_passes_the_map_on_both_sides_of_the_switch():
    x, w, ids, tw = case("bf16", 3, seed=500)
    ws, emap = compact(w, SLOTS_B)
    here = on_device(ids, SLOTS_B)
    thr = gap_threshold(moe_gate_ref(x, w, "bf16", ids), "silu", 0.5)
    y, active = moe_experts(x, ws, "bf16", ids, tw, "silu", thr, SparseSwitch.up_to(3), emap)
    ref, ref_active = moe_sparse_ref(x, w, "bf16", ids, tw * here, thr)
    assert torch.equal(active, torch.where(here, ref_active, 0))
    assert_close_rel(y, ref, RTOL)
    y, active = moe_experts(x, ws, "bf16", ids, tw, "silu", thr, None, emap)
    assert active is None
    assert_close_rel(y, moe_dense_ref(x, w, "bf16", ids, tw * here), RTOL)


def test_a_bad_map_is_refused():
    x, w, ids, tw = case("bf16", 1, seed=600)
    with pytest.raises(ValueError, match="int32"):
        moe_dense(x, w, "bf16", ids, tw, expert_map=torch.zeros(N_EXPERT, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32"):
        moe_dense(x, w, "bf16", ids, tw, expert_map=torch.zeros(2, 3, dtype=torch.int32))
