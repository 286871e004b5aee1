"""kernels.slot_repack: staged GGUF experts repacked straight into their slots in one launch,
against the torch reference (expert_formats.repack_rows, then index_copy_ into the slots)."""

import pytest
import torch
from gpu_device import DEVICE

from pyruntime.kernels.expert_formats import REPACKED, quantize_rows, repack_rows, row_bytes
from pyruntime.kernels.slot_repack import MAX_BATCH, repack_into_slots


def staged(fmt: str, n: int, n_ff: int, n_embd: int, seed: int) -> torch.Tensor:
    """n experts' GGUF bytes [n, n_ff * 3 * row_bytes] uint8, as the staging ring holds them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, n_ff, 3, n_embd, generator=g) * torch.rand(n, n_ff, 3, 1, generator=g)
    w[0, 0, 0, :32] = 0.0  # an all-zero block
    return quantize_rows(w, fmt).reshape(n, -1).to(DEVICE)


def reference(src: torch.Tensor, slots: list[int], out: torch.Tensor, fmt: str) -> None:
    n = len(slots)
    packed = repack_rows(src[:n].view(n, *out.shape[1:-1], -1), fmt)
    out.index_copy_(0, torch.tensor(slots, device=out.device), packed)


# n_embd: 3, 5 and 9 blocks (odd; 9 x 17 = 153 bytes pads to 160 for mxfp4r); n_ff odd
@pytest.mark.parametrize("fmt", sorted(REPACKED))
@pytest.mark.parametrize(("n_ff", "n_embd"), [(5, 96), (3, 160), (7, 288)])
def test_repack_into_slots_equals_repack_rows_then_index_copy(fmt, n_ff, n_embd):
    n_slots = 11
    src = staged(fmt, 4, n_ff, n_embd, seed=n_embd)
    shape = (n_slots, n_ff, 3, row_bytes(REPACKED[fmt], n_embd))
    g = torch.Generator().manual_seed(1)
    want = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEVICE)
    got = want.clone()
    slots = [9, 2, 3, 0]  # out of order, two consecutive
    reference(src, slots, want, fmt)
    repack_into_slots(src, slots, got, fmt, n_embd)
    assert torch.equal(got, want)  # the other slots untouched, the padding zeroed


def test_more_experts_than_one_launch_takes():
    fmt, n_ff, n_embd = "q8_0", 3, 64
    n = MAX_BATCH + 3
    src = staged(fmt, n, n_ff, n_embd, seed=5)
    shape = (n + 2, n_ff, 3, row_bytes("q8_0r", n_embd))
    want = torch.zeros(shape, dtype=torch.uint8, device=DEVICE)
    got = want.clone()
    slots = list(range(n + 1, 1, -1))
    reference(src, slots, want, fmt)
    repack_into_slots(src, slots, got, fmt, n_embd)
    assert torch.equal(got, want)


def test_bad_shapes_are_refused():
    src = staged("q4_0", 2, 3, 64, seed=0)
    out = torch.zeros((4, 3, 3, row_bytes("q4_0r", 64)), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="only"):
        repack_into_slots(src, [0], out, "f32", 64)
    with pytest.raises(ValueError, match="rows of 96 elements"):
        repack_into_slots(src, [0], out, "q4_0", 96)
    with pytest.raises(ValueError, match="src must be"):
        repack_into_slots(src, [0, 1, 2], out, "q4_0", 64)
