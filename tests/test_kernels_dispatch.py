"""kernels.dispatch: the dense/sparse choice of moe_experts, against the torch references."""

import torch

from pyruntime.kernels.dispatch import moe_experts, prepare_experts
from pyruntime.kernels.moe_dense import moe_dense_ref
from pyruntime.kernels.moe_sparse import moe_sparse_ref
from pyruntime.kernels.switch import SparseSwitch
from pyruntime.kernels.testing import assert_close_rel, make_case, rtol_for


def _case(fmt: str, n_tok: int):
    """Inputs, the GGUF expert tensor (for the references), its prepared form (for kernels)."""
    x, w, ids, tw = make_case(fmt, n_tok)
    wk, fmt_k = prepare_experts(w, fmt, x.shape[1])
    return x, w, wk, fmt_k, ids, tw


def test_dense_without_threshold():
    x, w, wk, fmt_k, ids, tw = _case("q8_0", 3)
    y, active = moe_experts(x, wk, fmt_k, ids, tw, "silu")
    assert active is None
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0", ids, tw, "silu"), rtol_for(x.dtype))


def test_sparse_where_the_switch_says_else_dense():
    x, w, wk, fmt_k, ids, tw = _case("bf16", 3)
    thr = 0.05
    y, active = moe_experts(x, wk, fmt_k, ids, tw, "silu", thr, SparseSwitch.up_to(3))
    ref, ref_active = moe_sparse_ref(x, w, "bf16", ids, tw, thr, "silu")
    assert active is not None and torch.equal(active, ref_active)
    assert int(active.sum()) < ids.numel() * w.shape[1]  # the threshold dropped neurons
    assert_close_rel(y, ref, rtol_for(x.dtype))
    for sw in (SparseSwitch.up_to(2), SparseSwitch((1, 4), (1,)), None):  # 3 takes 4's: dense
        y2, active2 = moe_experts(x, wk, fmt_k, ids, tw, "silu", thr, sw)
        assert active2 is None
    _, active3 = moe_experts(x, wk, fmt_k, ids, tw, "silu", thr, SparseSwitch((1, 4), (4,)))
    assert active3 is not None
    assert_close_rel(y2, moe_dense_ref(x, w, "bf16", ids, tw, "silu"), rtol_for(x.dtype))
