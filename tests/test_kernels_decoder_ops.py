"""kernels.decoder_ops (fused residual add + RMSNorm; q/k norm + rope + KV store; the shared
expert's sigmoid gate and sum) vs torch."""

import pytest
import torch
from gpu_device import DEVICE as DEV

from pyruntime.kernels.decoder_ops import (
    add_rms_norm,
    add_rms_norm_ref,
    qk_rope_store,
    qk_rope_store_ref,
    shared_gate_add,
    shared_gate_add_ref,
)
from pyruntime.model.rope import inv_frequencies, rope_tables


def _on(*ts):
    return [None if t is None else t.to(DEV) for t in ts]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


# (dtype of h, tolerance): f32 summation order only; bf16 output rounding (2^-9 relative).
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


@pytest.mark.parametrize("n, H", [(1, 100), (3, 64), (5, 257)])
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(n, H, dtype, tol, with_delta):
    g = torch.Generator().manual_seed(n * H)
    x = torch.randn(n, H, generator=g)
    delta = torch.randn(n, H, generator=g).to(dtype) if with_delta else None
    w = torch.rand(H, generator=g) + 0.5
    ref_x, ref_h = add_rms_norm_ref(x, delta, w, 1e-6, dtype, alpha=0.3)
    got_x, delta_d, w_d = _on(x, delta, w)
    h, h32 = add_rms_norm(got_x, delta_d, w_d, 1e-6, dtype, alpha=0.3, want_f32=True)
    got_x, h, h32 = got_x.cpu(), h.cpu(), h32.cpu()
    assert h.dtype == dtype and h32.dtype == torch.float32
    assert _rel_err(got_x, ref_x) <= 1e-6  # the residual add is exact up to rounding
    assert _rel_err(h, ref_h) <= tol
    assert (
        _rel_err(h32, ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-6) * w) <= 1e-5
    )


# (n_head, n_kv, D, rope_dim, norm): no norm (mixtral), norm over all heads (olmoe), per head
# (qwen3moe), partial rotary dims, a head_dim that is not a power of two.
CASES = [
    (4, 2, 16, 16, None),
    (4, 4, 16, 16, "all"),
    (6, 2, 24, 24, "head"),
    (4, 2, 32, 16, "head"),
    (2, 1, 20, 12, "all"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
def test_qk_rope_store(case, dtype, tol, n):
    n_head, n_kv, D, rope, norm = case
    S = 11
    g = torch.Generator().manual_seed(n_head * D + n)
    qkv = torch.randn(n, (n_head + 2 * n_kv) * D, generator=g).to(dtype)
    kv = torch.randn(2, n_kv, S, D, generator=g).to(dtype)
    positions = torch.tensor([7, 2, 9][:n])
    cos, sin = rope_tables(torch.arange(S), inv_frequencies(rope, 10000.0))
    q_norm = k_norm = None
    if norm == "all":
        q_norm = torch.rand(n_head * D, generator=g) + 0.5
        k_norm = torch.rand(n_kv * D, generator=g) + 0.5
    elif norm == "head":
        q_norm = torch.rand(D, generator=g) + 0.5
        k_norm = torch.rand(D, generator=g) + 0.5
    ref_q, ref_kv = qk_rope_store_ref(qkv, kv, positions, cos, sin, n_head, q_norm, k_norm)
    got_kv = kv.clone().to(DEV)
    q = qk_rope_store(*_on(qkv), got_kv, *_on(positions, cos, sin), n_head, *_on(q_norm, k_norm))
    q, got_kv = q.cpu(), got_kv.cpu()
    assert q.shape == (n_head, n, D) and q.dtype == dtype
    assert _rel_err(q, ref_q) <= tol
    assert _rel_err(got_kv, ref_kv) <= tol
    untouched = [p for p in range(S) if p not in positions.tolist()]
    assert torch.equal(got_kv[:, :, untouched], kv[:, :, untouched])  # only positions written


def test_qk_rope_store_clamp():
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, (2 + 2) * 8, generator=g) * 10
    kv = torch.zeros(2, 1, 4, 8)
    cos, sin = rope_tables(torch.arange(4), inv_frequencies(8, 10000.0))
    pos = torch.tensor([0, 3])
    ref_q, ref_kv = qk_rope_store_ref(qkv, kv, pos, cos, sin, 2, clamp=1.5)
    got_kv = kv.clone().to(DEV)
    q = qk_rope_store(*_on(qkv), got_kv, *_on(pos, cos, sin), 2, clamp=1.5)
    q, got_kv = q.cpu(), got_kv.cpu()
    assert _rel_err(q, ref_q) <= 1e-5 and _rel_err(got_kv, ref_kv) <= 1e-5


@pytest.mark.parametrize("n, H", [(1, 100), (3, 64), (5, 257)])
@pytest.mark.parametrize("s_dtype", [torch.float32, torch.bfloat16])
def test_shared_gate_add(n, H, s_dtype):
    """y + sigmoid(h . gate) * s per row: f32 summation order only (the gate's dot over H)."""
    g = torch.Generator().manual_seed(n + H)
    y, h32 = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
    s = torch.randn(n, H, generator=g).to(s_dtype)
    gate = torch.randn(H, generator=g) * H**-0.5
    want = shared_gate_add_ref(y, s, h32, gate)
    got = shared_gate_add(*_on(y, s, h32, gate)).cpu()
    assert got.dtype == torch.float32 and _rel_err(got, want) <= 1e-6
    with pytest.raises(ValueError, match="gate \\[H\\]"):
        shared_gate_add(*_on(y, s, h32, gate[1:]))


@pytest.mark.parametrize("mode", ["l2", "nope"])
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_qk_rope_store_llama4_layers(mode, dtype, tol):
    """llama4: rope layers L2-normalize q and k per head after rope; NoPE layers skip rope and
    scale q by 1 + 0.5 log(1 + floor((pos + 1) / 4)) of each token's own position (positions
    3..11 cross several temperature steps)."""
    n_head, n_kv, D, S = 4, 2, 24, 13
    g = torch.Generator().manual_seed(17)
    qkv = (torch.randn(3, (n_head + 2 * n_kv) * D, generator=g) * 3).to(dtype)
    kv = torch.randn(2, n_kv, S, D, generator=g).to(dtype)
    positions = torch.tensor([3, 7, 11])
    cos, sin = rope_tables(torch.arange(S), inv_frequencies(D, 500000.0))
    opts = dict(l2_norm=True) if mode == "l2" else dict(rope=False, temperature=(4, 0.5))
    ref_q, ref_kv = qk_rope_store_ref(qkv, kv, positions, cos, sin, n_head, **opts)
    got_kv = kv.clone().to(DEV)
    q = qk_rope_store(*_on(qkv), got_kv, *_on(positions, cos, sin), n_head, **opts).cpu()
    assert _rel_err(q, ref_q) <= tol and _rel_err(got_kv.cpu(), ref_kv) <= tol
    # the option changed the result: not the plain rope path's q
    plain_q, _ = qk_rope_store_ref(qkv, kv, positions, cos, sin, n_head)
    assert _rel_err(q, plain_q) > 0.1
    if mode == "nope":  # q of the first token (pos 3, scale 1 + 0.5 log 2) vs the raw columns
        raw = qkv[0, : n_head * D].float().view(n_head, D)
        assert _rel_err(q[:, 0], raw * (1 + 0.5 * torch.log(torch.tensor(2.0)))) <= tol
