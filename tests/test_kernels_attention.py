"""kernels.attention.decode_attention vs the plain torch reference (interpreter on CPU)."""

import pytest
import torch
from gpu_device import DEVICE as DEV

from pyruntime.kernels.attention import decode_attention, decode_attention_ref


def _case(n_head, n_kv, max_tokens, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_head, d, generator=g).to(dtype)
    k = torch.randn(n_kv, max_tokens, d, generator=g).to(dtype)
    v = torch.randn(n_kv, max_tokens, d, generator=g).to(dtype)
    return q, k, v


# (n_head, n_kv, max_tokens, head_dim, n): odd lengths, GQA, head_dim not a power of two,
# a length that leaves some splits empty, and the full cache.
SHAPES = [(4, 2, 37, 32, 1), (4, 2, 37, 32, 29), (6, 3, 130, 24, 130), (2, 2, 200, 16, 70)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_attention_matches_reference(shape, dtype, tol):
    n_head, n_kv, max_tokens, d, n = shape
    q, k, v = _case(n_head, n_kv, max_tokens, d, dtype, seed=n + d)
    # Garbage past n must not leak into the result: the kernel reads only the cached length.
    k[:, n:] = 1e4
    v[:, n:] = float("nan")
    scale = d**-0.5
    seq_len = torch.tensor([n], dtype=torch.int32, device=DEV)
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), seq_len, scale, n_split=4, block_s=16)
    out = out.cpu()
    ref = decode_attention_ref(q, k, v, n, scale)
    assert out.dtype == dtype and out.shape == (n_head, d)
    # fp32: summation order only; bf16: the output is rounded to bf16 (2^-9 relative).
    assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_decode_attention_length_from_device_tensor():
    """One set of buffers, the length changed in place (as a CUDA graph replay sees it)."""
    q, k, v = _case(4, 4, 50, 32, torch.float32, seed=1)
    seq_len = torch.tensor([1], dtype=torch.int32, device=DEV)
    qd, kd, vd = q.to(DEV), k.to(DEV), v.to(DEV)
    for n in (1, 17, 50):
        seq_len.fill_(n)
        out = decode_attention(qd, kd, vd, seq_len, 0.2, n_split=2, block_s=16).cpu()
        ref = decode_attention_ref(q, k, v, n, 0.2)
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_decode_attention_rejects_bad_shapes():
    q, k, v = _case(3, 2, 10, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="n_head % n_kv"):
        decode_attention(q, k, v, torch.tensor([5], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("n_split, block_s, n", [(1, 16, 37), (8, 64, 5), (16, 16, 37)])
def test_decode_attention_split_counts(n_split, block_s, n):
    """One split (no merge), tiles wider than a split, and more splits than positions (empty
    splits merged in); the grid_sync counters are all back at 0 after each launch."""
    from pyruntime.kernels.grid_sync import counters

    q, k, v = _case(4, 2, 37, 32, torch.float32, seed=n_split)
    seq_len = torch.tensor([n], dtype=torch.int64, device=DEV)
    for _ in range(2):
        out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), seq_len, 0.3, n_split, block_s)
        ref = decode_attention_ref(q, k, v, n, 0.3)
        assert (out.cpu() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        assert not counters(DEV).any()


@pytest.mark.parametrize("window", [0, 1, 8, 36, 100])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_window_and_sinks(window, with_sinks):
    """gpt-oss: a sliding window (the last `window` positions; positions before it hold
    garbage that must not leak) and per-head sink logits in the softmax's denominator."""
    n_head, n_kv, max_tokens, d, n = 4, 2, 40, 24, 37
    q, k, v = _case(n_head, n_kv, max_tokens, d, torch.float32, seed=window)
    if 0 < window < n:
        k[:, : n - window] = 1e4
        v[:, : n - window] = float("nan")
    sinks = None
    if with_sinks:
        sinks = torch.randn(n_head, generator=torch.Generator().manual_seed(3)) * 2
    seq_len = torch.tensor([n], dtype=torch.int32, device=DEV)
    dev_sinks = None if sinks is None else sinks.to(DEV)
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), seq_len, 0.3, n_split=4, block_s=8,
                           window=window, sinks=dev_sinks).cpu()  # fmt: skip
    ref = decode_attention_ref(q, k, v, n, 0.3, window, sinks)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    if with_sinks:  # the sinks took probability mass: not the plain attention
        plain = decode_attention_ref(q, k, v, n, 0.3, window)
        assert (plain - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("n", [1, 8, 9, 21, 37])
def test_decode_attention_chunk(n):
    """llama4's chunked layers: the query (position n - 1) sees its own chunk of 8 positions
    only; the earlier chunks hold garbage that must not leak."""
    n_head, n_kv, max_tokens, d, chunk = 4, 2, 40, 24, 8
    q, k, v = _case(n_head, n_kv, max_tokens, d, torch.float32, seed=n)
    first = (n - 1) // chunk * chunk
    k[:, :first] = 1e4
    v[:, :first] = float("nan")
    seq_len = torch.tensor([n], dtype=torch.int32, device=DEV)
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), seq_len, 0.3, n_split=4, block_s=8,
                           chunk=chunk).cpu()  # fmt: skip
    clean_k, clean_v = k[:, first:], v[:, first:]
    ref = decode_attention_ref(q, clean_k, clean_v, n - first, 0.3)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(decode_attention_ref(q, k, v, n, 0.3, chunk=chunk), ref)
