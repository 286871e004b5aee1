"""kernels.q8_embed: the Q8_0 token-embedding gather vs plain torch (dequantize the matrix,
then index its rows)."""

import pytest
import torch
from gpu_device import DEVICE as DEV

from pyruntime.kernels.expert_formats import quantize_rows
from pyruntime.kernels.q8_embed import q8_embed, q8_embed_ref
from pyruntime.kernels.q8_linear import q4_0_as_q8_0, split_q8_0


def _q8(n_vocab: int, K: int, fmt: str = "q8_0", seed: int = 0):
    w = torch.randn(n_vocab, K, generator=torch.Generator().manual_seed(seed))
    split = split_q8_0 if fmt == "q8_0" else q4_0_as_q8_0
    return split(quantize_rows(w, fmt), K)


# K a multiple of 32 but not of 64 (and past one 1024-column program on a GPU); repeated and
# out-of-order ids, the first and last rows; 1 and 300 ids.
@pytest.mark.parametrize("n_vocab, K", [(50, 96), (37, 1120)])
@pytest.mark.parametrize("n", [1, 300])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_q8_embed_matches_reference(n_vocab, K, n, dtype):
    q, d = _q8(n_vocab, K, seed=K + n)
    ids = torch.randint(0, n_vocab, (n,), generator=torch.Generator().manual_seed(n))
    if n > 3:
        ids[:4] = torch.tensor([n_vocab - 1, 0, n_vocab - 1, 5])
    x = q8_embed(ids.to(dtype).to(DEV), q.to(DEV), d.to(DEV)).cpu()
    assert x.dtype == torch.float32 and x.shape == (n, K)
    assert torch.equal(x, q8_embed_ref(ids, q, d))  # the exact products: bit for bit


def test_q8_embed_scale_and_q4_0_rows():
    """A Q4_0 embedding kept as Q8_0 (q4_0_as_q8_0) and an embedding scale (gemma-style
    sqrt(n_embd)): rounded once, as the CPU path's rows * scale."""
    q, d = _q8(19, 160, fmt="q4_0")
    ids = torch.tensor([3, 3, 18, 0, 7])
    scale = 160**0.5
    x = q8_embed(ids.to(DEV), q.to(DEV), d.to(DEV), scale).cpu()
    assert torch.equal(x, q8_embed_ref(ids, q, d, scale))
    assert not torch.equal(x, q8_embed_ref(ids, q, d))


def test_q8_embed_checks_its_arguments():
    q, d = _q8(8, 64)
    assert q8_embed(torch.zeros(0, dtype=torch.int64), q, d).shape == (0, 64)
    with pytest.raises(ValueError, match="ids \\[n\\], q int8 \\[N, K\\], d \\[N, K/32\\]"):
        q8_embed(torch.zeros(2, 1, dtype=torch.int64), q, d)
    with pytest.raises(ValueError, match="d \\[N, K/32\\]"):
        q8_embed(torch.zeros(2, dtype=torch.int64), q, d[:, :1])
