"""kernels.router.router_topk vs the torch routing of the CPU model (experts.compute.route)."""

import os

import pytest
import torch

from kernels.router import router_topk
from pyruntime.experts.compute import route

DEV = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"


@pytest.mark.parametrize("T, E, k", [(1, 64, 8), (5, 60, 4), (3, 128, 8), (2, 8, 2), (4, 7, 3)])
@pytest.mark.parametrize("renorm", [False, True])
def test_router_topk_matches_route(T, E, k, renorm):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * E + k)) * 3
    ids, w = router_topk(logits.to(DEV), k, renorm)
    ref_ids, ref_w = route(logits, k, renorm)
    assert torch.equal(ids.cpu(), ref_ids)  # same experts, same (descending) order
    # fp32 softmax: exp and division rounding only.
    assert torch.allclose(w.cpu(), ref_w, rtol=1e-5, atol=1e-7)


def test_router_topk_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        router_topk(torch.zeros(1, 4, device=DEV), 5, False)
