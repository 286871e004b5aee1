"""kernels.expert_gather against plain indexing, at odd sizes (a tail of a block of words)."""

import pytest
import torch

from kernels.expert_gather import gather_experts
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
