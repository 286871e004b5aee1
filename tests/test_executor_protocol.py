"""The Executor protocol on the CPU executor: k experts per call and the routing trace.

Big/little decoding runs the same model with k = K/2 and then K experts, and prefetches from the
routing of the little pass; these check that a forward with k is the model with n_expert_used = k
and that the trace reports what was routed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.errors import UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.reference import ReferenceModel


@pytest.fixture(scope="module", params=["olmoe", "qwen2moe"])
def gguf_path(request, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_hf_model(request.param, tmp / "hf")
    return convert(hf, tmp / "m.gguf", "f32", progress=False)


def ids_for(net, n: int = 9, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, net.config.n_vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_k_per_call_is_the_model_with_that_many_experts(gguf_path, backend):
    net = CpuExecutor.from_gguf(open_gguf(gguf_path), expert_backend=backend)
    cfg = net.config
    ids = ids_for(net)
    for k in sorted({1, cfg.n_expert_used // 2 or 1, cfg.n_expert}):
        ref = ReferenceModel(dataclasses.replace(cfg, n_expert_used=k), net.weights)
        want = ref.forward(ids, ref.new_cache(len(ids)))
        cache = net.new_cache(len(ids))
        got = torch.cat([net.forward(ids[:5], cache, k=k)] + [
            net.forward([t], cache, k=k) for t in ids[5:]
        ])  # fmt: skip
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"k={k}"
    with pytest.raises(UsageError, match="experts per token"):
        net.forward(ids, net.new_cache(len(ids)), k=cfg.n_expert + 1)


def test_routing_trace_reports_the_last_tokens_routing(gguf_path):
    net = CpuExecutor.from_gguf(open_gguf(gguf_path), expert_backend="c")
    cfg = net.config
    ids = ids_for(net, seed=1)
    k = max(1, cfg.n_expert_used // 2)
    trace = RoutingTrace(layers=[])
    cache = net.new_cache(len(ids))
    net.forward(ids, cache, k=k, routing=trace)
    moe = [i for i, b in enumerate(net.weights.blocks) if b.experts is not None]
    assert trace.layers == moe
    assert trace.ids.shape == (len(moe), k) and trace.logits.shape == (len(moe), cfg.n_expert)
    top = torch.topk(torch.softmax(trace.logits, dim=-1), k, dim=-1).indices
    assert torch.equal(trace.ids, top)
    # The same last token decoded after a prefill of the others routes the same way.
    step = RoutingTrace(layers=[])
    cache = net.new_cache(len(ids))
    net.forward(ids[:-1], cache, k=k)
    net.forward(ids[-1:], cache, k=k, routing=step)
    assert torch.equal(step.ids, trace.ids)
    assert torch.allclose(step.logits, trace.logits, atol=1e-5)
