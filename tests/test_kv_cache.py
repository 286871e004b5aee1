"""The shared KV cache (pyruntime.model.kv_cache) and Session.rewind on the CPU executor.

Rewinding is what big/little decoding and draft-and-verify rely on: after rewind(n) the next
tokens must see exactly the cache a sequence without the dropped tokens would have.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.decoding.session import Session
from pyruntime.errors import UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.model.config import ModelConfig
from pyruntime.model.kv_cache import KVCache


def tiny_config() -> ModelConfig:
    return ModelConfig(
        arch="olmoe", n_vocab=32, n_embd=8, n_layer=3, n_head=2, n_head_kv=1, head_dim=4,
        n_expert=4, n_expert_used=2, n_ff_exp=8, context_length=64, rms_eps=1e-6,
        rope_theta=1e4, rope_dim=4, expert_weights_norm=False,
    )  # fmt: skip


def test_growth_keeps_the_cached_positions_and_drops_executor_state():
    cache = KVCache(tiny_config(), max_tokens=600)
    assert cache.capacity == 0
    cache.reserve(5)
    for layer in range(3):
        cache.k[layer][:, :5] = torch.arange(20.0).reshape(1, 5, 4) + layer
        cache.v[layer][:, :5] = -cache.k[layer][:, :5]
    cache.n_tokens = 5
    cache.executor_state["x"] = object()
    before = [t[:, :, :5].clone() for t in cache.kv]
    cache.reserve(300)  # past the first chunk: the storage moves
    assert cache.capacity >= 305 and cache.executor_state == {}
    for layer in range(3):
        assert torch.equal(cache.kv[layer][:, :, :5], before[layer])
        assert cache.k[layer].data_ptr() == cache.kv[layer].data_ptr()
        assert cache.k[layer].is_contiguous() and cache.v[layer].is_contiguous()


def test_fixed_cache_never_moves_and_refuses_overflow():
    cache = KVCache(tiny_config(), max_tokens=16, growable=False)
    assert cache.capacity == 16
    ptr = cache.kv[0].data_ptr()
    cache.reserve(16)
    assert cache.kv[0].data_ptr() == ptr
    cache.n_tokens = 16
    with pytest.raises(UsageError, match="context is full"):
        cache.reserve(1)


def test_rewind_bounds():
    cache = KVCache(tiny_config(), max_tokens=8)
    cache.reserve(4)
    cache.n_tokens = 4
    cache.rewind(3)
    assert cache.n_tokens == 1
    with pytest.raises(UsageError, match="cannot rewind 2"):
        cache.rewind(2)


@pytest.fixture(scope="module")
def olmoe_gguf(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("kv")
    return convert(make_tiny_hf_model("olmoe", tmp / "hf"), tmp / "m.gguf", "f32", progress=False)


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_session_rewind_continues_as_if_the_tokens_were_never_fed(olmoe_gguf, backend):
    net = CpuExecutor.from_gguf(open_gguf(olmoe_gguf), expert_backend=backend)
    ids = torch.randint(0, net.config.n_vocab, (12,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    s = Session(net, 32)
    s.prefill(ids[:6])
    for t in [7, 8, 9]:  # tokens a draft proposed and a verifier rejected
        s.feed(t)
    s.rewind(3)
    assert s.ids == ids[:6] and s.cache.n_tokens == 6
    after_rewind = torch.stack([s.feed(t) for t in ids[6:]])

    fresh = Session(net, 32)
    fresh.prefill(ids[:6])
    expected = torch.stack([fresh.feed(t) for t in ids[6:]])
    assert torch.equal(after_rewind, expected)
    with pytest.raises(UsageError, match="cannot rewind 13"):
        s.rewind(13)
