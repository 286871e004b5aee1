"""kernels.router.router_topk vs the reference routing (pyruntime.model.reference.route)."""

import pytest
import torch
from gpu_device import DEVICE as DEV

from pyruntime.kernels.grid_sync import counters
from pyruntime.kernels.router import add_norm_router, add_norm_router_ref, router_topk
from pyruntime.model.reference import route


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


# (T, H, E, k): H not a power of two, E not a multiple of the expert tile, several tokens.
@pytest.mark.parametrize("T, H, E, k", [(1, 96, 64, 8), (3, 40, 37, 4), (2, 64, 8, 2)])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_norm_router_matches_reference(T, H, E, k, renorm, with_delta):
    g = torch.Generator().manual_seed(T * H + E + k)
    x = torch.randn(T, H, generator=g)
    delta = torch.randn(T, H, generator=g) if with_delta else None
    norm_w = torch.rand(H, generator=g) + 0.5
    router_w = torch.randn(E, H, generator=g) * H**-0.5 * 4
    alpha, eps = 0.7, 1e-6
    args = (norm_w, router_w, eps, k, renorm, torch.bfloat16)
    for _ in range(2):  # the second launch finds its grid_sync counters reset
        out = add_norm_router(x.to(DEV), None if delta is None else delta.to(DEV),
                              *(a.to(DEV) if torch.is_tensor(a) else a for a in args),
                              alpha=alpha, want_f32=True)  # fmt: skip
        x1, h, h32, ids, w, logits = (t.cpu() for t in out)
        rx1, rh, rh32, rids, rw, rlogits = add_norm_router_ref(x, delta, *args, alpha=alpha)
        assert torch.allclose(x1, rx1, rtol=1e-6, atol=1e-6)
        assert h.dtype == torch.bfloat16 and torch.allclose(h.float(), rh.float(), rtol=1e-2)
        assert torch.allclose(h32, rh32, rtol=1e-5, atol=1e-6)
        assert torch.equal(ids, rids)
        assert torch.allclose(w, rw, rtol=1e-5, atol=1e-7)
        assert torch.allclose(logits, rlogits, rtol=1e-5, atol=1e-5)  # the router's logits
        assert not counters(DEV).any()  # the last program put its counter back to 0
    assert x.data_ptr() != x1.data_ptr()  # x itself is not modified: a new residual


def test_add_norm_router_without_f32_copy():
    x = torch.randn(1, 32, device=DEV)
    _, h, h32, ids, _, _ = add_norm_router(x, None, torch.ones(32, device=DEV),
                                        torch.randn(4, 32, device=DEV), 1e-6, 2, True,
                                        torch.float32)  # fmt: skip
    assert h32 is None and h.dtype == torch.float32 and ids.shape == (1, 2)


def test_add_norm_router_with_a_router_bias():
    """gpt-oss's router bias joins the logits before the softmax and top-k."""
    g = torch.Generator().manual_seed(9)
    T, H, E, k = 2, 40, 9, 3
    x = torch.randn(T, H, generator=g)
    norm_w = torch.rand(H, generator=g) + 0.5
    router_w = torch.randn(E, H, generator=g) * H**-0.5
    bias = torch.randn(E, generator=g) * 2
    out = add_norm_router(x.to(DEV), None, norm_w.to(DEV), router_w.to(DEV), 1e-6, k, True,
                          torch.float32, router_bias=bias.to(DEV))  # fmt: skip
    ids, w, logits = (t.cpu() for t in out[3:])
    _, _, _, rids, rw, rlogits = add_norm_router_ref(x, None, norm_w, router_w, 1e-6, k, True,
                                                     torch.float32, router_bias=bias)  # fmt: skip
    assert torch.allclose(logits, rlogits, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, rids) and torch.allclose(w, rw, rtol=1e-5, atol=1e-7)
    unbiased = add_norm_router_ref(x, None, norm_w, router_w, 1e-6, k, True, torch.float32)[3]
    assert not torch.equal(unbiased, rids)  # the bias changed the choice
