"""kernels.expert_gather against plain indexing, at odd sizes (a tail of a block of words)."""

import pytest
import torch

from kernels.expert_gather import gather_experts, gather_neuron_rows
from kernels.testing import DEVICE


@pytest.mark.parametrize(
    "dtype,shape", [(torch.uint8, (7, 3, 3, 68)), (torch.float32, (5, 2, 3, 40))]
)
def test_gathers_the_coded_pairs_into_their_rows(dtype, shape):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 255, shape, generator=g).to(dtype).to(DEVICE)
    dst = torch.full((4, *shape[1:]), 7, dtype=dtype, device=DEVICE)
    ids = torch.tensor([3, 0, shape[0] - 1, 1], device=DEVICE)
    codes = torch.tensor([1, 2, 1, 1], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 0, 0, 3], dtype=torch.int32, device=DEVICE)
    gather_experts(src, dst, ids, codes, rows, 1)
    want = torch.full_like(dst, 7)
    want[2], want[0], want[3] = src[3], src[shape[0] - 1], src[1]  # pair 1 is not coded 1
    assert torch.equal(dst, want)


def test_refuses_experts_of_other_shapes_or_partial_words():
    src = torch.zeros(3, 2, 3, 6, dtype=torch.uint8, device=DEVICE)
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="different experts"):
        gather_experts(src, torch.zeros(2, 2, 3, 8, dtype=torch.uint8, device=DEVICE), ids, one,
                       one, 0)  # fmt: skip
    odd = torch.zeros(3, 1, 3, 5, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="int32 words"):
        gather_experts(odd, odd.clone(), ids, one, one, 0)


@pytest.mark.parametrize(
    "dtype,shape",  # rows of 34 bytes (int16 words), 35 (bytes), 68 (int32), f16 rows of 5
    [(torch.uint8, (6, 19, 3, 34)), (torch.uint8, (5, 9, 3, 35)), (torch.uint8, (5, 17, 3, 68)),
     (torch.float16, (4, 11, 3, 5))],
)  # fmt: skip
def test_gathers_rows_of_all_or_of_the_listed_neurons(dtype, shape):
    g = torch.Generator().manual_seed(1)
    n_ff = shape[1]
    src = torch.randint(0, 255, shape, generator=g).to(dtype).to(DEVICE)
    ids = torch.tensor([3, 0, shape[0] - 1, 1], device=DEVICE)
    codes = torch.tensor([1, 2, 1, 1], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    pairs = [(0, 3, 2), (2, shape[0] - 1, 0), (3, 1, 1)]  # (pair, expert, buffer row) coded 1

    dst = torch.full((3, *shape[1:]), 7, dtype=dtype, device=DEVICE)
    gather_neuron_rows(src, dst, ids, codes, rows, 1, (0, 1))  # every neuron's gate row
    want = torch.full_like(dst, 7)
    for _, e, b in pairs:
        want[b, :, 0] = src[e, :, 0]
    assert torch.equal(dst, want)

    # then the up and down rows of the first count[j] neurons idx[j] (the rest of idx junk)
    idx = torch.randint(0, n_ff, (4, n_ff), generator=g, dtype=torch.int32)
    count = torch.tensor([min(5, n_ff), n_ff, 0, n_ff - 1], dtype=torch.int32)
    gather_neuron_rows(src, dst, ids, codes, rows, 1, (1, 3), idx.to(DEVICE), count.to(DEVICE))
    for j, e, b in pairs:
        kept = idx[j, : count[j]].long()
        kept = kept.to(DEVICE)
        want[b, kept, 1:] = src[e, kept, 1:]
    assert torch.equal(dst, want)


def test_neuron_rows_refuse_rows_outside_a_neuron():
    src = torch.zeros(3, 2, 3, 6, dtype=torch.uint8, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="within the 3 rows"):
        gather_neuron_rows(src, src.clone(), one, one, one, 0, (2, 4))
    with pytest.raises(ValueError, match="one expert shape"):
        gather_neuron_rows(src, src[:, :1].clone(), one, one, one, 0, (0, 1))
