"""The GPU executor's seams for offloading and big/little: k experts per call, the routing trace,
rewinding the cache under captured graphs, the per-layer pieces, expert maps.

Each against the torch reference (pyruntime.model.reference) or against forward() itself, on the
CPU under the Triton interpreter; the CUDA graph path through tests/eager_graph.py. Tolerances
are those of tests/test_gpu_model.py (f32 GGUF: |d log-prob| <= 1e-3 against the reference);
where both sides run the same kernels in the same order the results are equal bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from eager_graph import use_eager_graphs
from gpu_device import DEVICE, INTERPRET, assert_same_run
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.errors import UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.gpu.executor import GpuExecutor
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import RoutingTrace
from pyruntime.model.reference import (
    ReferenceModel,
    expert_ffn_torch,
    moe_ffn_torch,
    torch_linear,
)
from pyruntime.model.weights import HostWeights

LOGPROB_TOL = 1e-3


# olmoe; qwen2moe: a shared expert with its sigmoid gate and a dense-FFN layer
ARCHS = ["olmoe", "qwen2moe"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"seams-{request.param}")
    hf_dir = make_tiny_hf_model(request.param, tmp / "hf", tie_word_embeddings=True)
    f = open_gguf(convert(hf_dir, tmp / "m.gguf", "f32", progress=False))
    cfg = ModelConfig.from_gguf(f)
    return cfg, HostWeights.from_gguf(f, cfg)


def _ids(n_vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_vocab, (n,), generator=g).tolist()


def _logprobs(forward, cache, ids: list[int], split: int) -> torch.Tensor:
    """Prefill ids[:split], then decode the rest one token at a time."""
    parts = [forward(ids[:split], cache)]
    parts += [forward(ids[j : j + 1], cache) for j in range(split, len(ids))]
    return torch.log_softmax(torch.cat(parts).double(), dim=-1)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# -- k per call ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_forward_with_k_matches_the_reference_built_with_that_k(model, k):
    cfg, host = model
    dev = GpuExecutor(cfg, host, DEVICE)
    ref = ReferenceModel(replace(cfg, n_expert_used=k), host)
    ids = _ids(cfg.n_vocab, 10, seed=k)
    want = _logprobs(ref.forward, ref.new_cache(10), ids, 6)
    got = _logprobs(lambda t, c: dev.forward(t, c, k=k), dev.new_cache(10), ids, 6)
    assert _max_err(got, want) <= LOGPROB_TOL
    default = _logprobs(ReferenceModel(cfg, host).forward, ReferenceModel(cfg, host).new_cache(10),
                        ids, 6)  # fmt: skip
    assert _max_err(got, default) > 2 * LOGPROB_TOL  # k changed the result


def test_a_graph_per_k_each_replayed(model, monkeypatch):
    """Decode steps with k = 1, the default, 1 again: one capture per k on a cache (a second
    k does not replace the first), and the replays equal eager decoding with the same ks."""
    cfg, host = model
    eager = GpuExecutor(cfg, host, DEVICE)
    eager.cuda_graphs = False  # on CUDA both default to graphs; only dev's captures count
    dev = GpuExecutor(cfg, host, DEVICE)
    captures = use_eager_graphs(monkeypatch, dev)
    ids = _ids(cfg.n_vocab, 9, seed=4)
    ks = [1, None, None, 1, None]
    ce, cg = eager.new_cache(9), dev.new_cache(9)
    eager.forward(ids[:4], ce)
    dev.forward(ids[:4], cg)
    for t, k in zip(ids[4:], ks, strict=True):
        assert_same_run(dev.forward([t], cg, k=k), eager.forward([t], ce, k=k))
    assert len(captures) == 2
    with pytest.raises(UsageError, match="experts per token"):
        dev.forward([1], cg, k=cfg.n_expert + 1)


# -- routing trace ---------------------------------------------------------------------------


def test_routing_trace_is_the_references_routing(model, monkeypatch):
    """Prefill and decode (through a captured step): each MoE layer's top-k ids and router
    logits of the last token, as the reference routed it."""
    cfg, host = model
    ref = ReferenceModel(cfg, host)
    seen: dict[int, tuple] = {}

    def observe(i, store, x, ids, activation):
        seen[i] = (ids[-1], torch_linear(x[-1:], host.blocks[i].router)[0])

    ref.gate_observer = observe
    dev = GpuExecutor(cfg, host, DEVICE)
    use_eager_graphs(monkeypatch, dev)
    rc, dc = ref.new_cache(8), dev.new_cache(8)
    ids = _ids(cfg.n_vocab, 7, seed=5)
    for tokens in (ids[:6], ids[6:]):
        seen.clear()
        ref.forward(tokens, rc)
        trace = RoutingTrace(layers=[])
        dev.forward(tokens, dc, routing=trace)
        assert trace.layers == sorted(seen) and trace.layers  # MoE layers only, in order
        assert trace.ids.shape == (len(seen), cfg.n_expert_used)
        assert trace.logits.shape == (len(seen), cfg.n_expert)
        for row, layer in enumerate(trace.layers):
            want_ids, want_logits = seen[layer]
            assert torch.equal(trace.ids[row], want_ids)
            torch.testing.assert_close(trace.logits[row], want_logits, rtol=1e-4, atol=1e-5)


# -- rewind ----------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_after_rewind_equals_a_cache_that_never_saw_the_dropped(model, graphs,
                                                                      monkeypatch):  # fmt: skip
    cfg, host = model
    dev = GpuExecutor(cfg, host, DEVICE)
    captures = use_eager_graphs(monkeypatch, dev) if graphs else []
    ids = _ids(cfg.n_vocab, 10, seed=6)
    prompt, dropped, after = ids[:5], ids[5:8], ids[8:]
    a, b = dev.new_cache(12), dev.new_cache(12)
    dev.forward(prompt, a)
    for t in dropped:
        dev.forward([t], a)
    a.rewind(2)  # keeps dropped[0]
    dev.forward(prompt, b)
    dev.forward(dropped[:1], b)
    assert a.n_tokens == b.n_tokens == 6
    for t in after:
        assert_same_run(dev.forward([t], a), dev.forward([t], b))
    assert len(captures) == (2 if graphs else 0)  # one per cache, replayed after the rewind


# -- per-layer pieces ------------------------------------------------------------------------


def run_pieces(dev: GpuExecutor, tokens, cache, experts=None) -> torch.Tensor:
    """forward() by hand: the per-layer pieces, one layer at a time. experts(i, routed) -> y
    stands in for the routed-experts piece when given."""
    layers = dev.layers
    with torch.inference_mode():
        span = dev.span(tokens, cache)
        x, delta = layers.embed(span.ids), None
        for i, blk in enumerate(dev.blocks):
            x, delta = layers.attention(i, x, delta, cache.kv[i], span)
            if blk.experts is None:
                x, h, _ = layers.ffn_norm(i, x, delta)
                delta = layers.dense_ffn(i, h)
                continue
            r = layers.route(i, x, delta, dev.config.n_expert_used)
            y = layers.routed_experts(i, r)[0] if experts is None else experts(i, r)
            delta = layers.ffn_output(i, r, y)
            x = r.x
        logits = layers.output(x, delta)
    cache.n_tokens += span.n
    return logits.float().cpu()


def test_running_the_pieces_layer_by_layer_equals_forward(model):
    cfg, host = model
    dev = GpuExecutor(cfg, host, DEVICE)
    ids = _ids(cfg.n_vocab, 8, seed=7)
    c1, c2 = dev.new_cache(8), dev.new_cache(8)
    for tokens in (ids[:6], ids[6:7], ids[7:]):  # a prefill (grouped GEMMs), two decode steps
        assert_same_run(run_pieces(dev, tokens, c2), dev.forward(tokens, c1))


# -- expert maps -----------------------------------------------------------------------------


def _subsets(cfg: ModelConfig) -> dict[int, list[int]]:
    """Per layer, the experts "on the GPU": about half, a different half in each layer."""
    return {i: [e for e in range(cfg.n_expert) if (e + i) % 2 == 0] for i in range(cfg.n_layer)}


def _identity_maps(dev: GpuExecutor, subsets) -> list:
    maps = []
    for i, blk in enumerate(dev.blocks):
        if blk.experts is None:
            maps.append(None)
            continue
        m = torch.full((dev.config.n_expert,), -1, dtype=torch.int32)
        m[subsets[i]] = torch.tensor(subsets[i], dtype=torch.int32)
        maps.append(m.to(dev.device))
    return maps


@pytest.mark.parametrize("threshold", [None, 0.05])
def test_forward_with_expert_maps_computes_only_the_mapped_experts(model, threshold):
    """Per-layer maps into each layer's own expert tensor: logits of the reference whose routed
    experts skip the unmapped ones, and stats counting only the pairs computed (dense, and with
    a sparsity threshold the active neurons the kernels counted)."""
    cfg, host = model
    if INTERPRET and threshold is not None and cfg.arch != "olmoe":
        pytest.skip("sparse with maps on olmoe only (interpreter time)")
    subsets = _subsets(cfg)
    layer_of = {id(b.experts): i for i, b in enumerate(host.blocks) if b.experts is not None}
    computed = [0, 0]  # pairs, active neurons

    def mapped_experts(store, x, ids, w, act, threshold):
        y, n_active = torch.zeros_like(x), 0
        for e in subsets[layer_of[id(store)]]:
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            out, active = expert_ffn_torch(store.expert_weights(e), x[tok], act, threshold)
            y.index_add_(0, tok, out * w[tok, slot].unsqueeze(1))
            computed[0] += tok.numel()
            n_active += active
        computed[1] += n_active
        return y, n_active

    ref = ReferenceModel(cfg, host, experts=mapped_experts)
    dev = GpuExecutor(cfg, host, DEVICE)
    if threshold is not None:
        ref.expert_threshold = [threshold] * cfg.n_layer
        dev.set_expert_threshold(ref.expert_threshold)
    maps = _identity_maps(dev, subsets)
    ids = _ids(cfg.n_vocab, 9, seed=8)
    want = _logprobs(ref.forward, ref.new_cache(9), ids, 6)
    got = _logprobs(lambda t, c: dev.forward(t, c, expert_maps=maps), dev.new_cache(9), ids, 6)
    assert _max_err(got, want) <= LOGPROB_TOL
    full = _logprobs(ReferenceModel(cfg, host).forward, ReferenceModel(cfg, host).new_cache(9),
                     ids, 6)  # fmt: skip
    assert _max_err(got, full) > 2 * LOGPROB_TOL  # the maps did leave experts out
    assert computed[0] > 0 and dev.stats.pairs == computed[0]
    assert dev.stats.neurons == computed[0] * cfg.n_ff_exp
    assert dev.stats.active == computed[1]
    if threshold is not None:
        assert 0 < computed[1] < dev.stats.neurons


def test_gpu_part_plus_the_reference_remaining_experts_is_the_full_result(model):
    """The hybrid a CPU/GPU split will run: per MoE layer, the GPU computes the experts held in
    a compact slot tensor (an expert map into it), the reference the others; the sum equals the
    whole model on the GPU, through prefill and decode."""
    cfg, host = model
    dev = GpuExecutor(cfg, host, DEVICE)
    subsets = _subsets(cfg)
    slots, maps = {}, {}
    for i, blk in enumerate(dev.blocks):
        if blk.experts is not None:
            order = subsets[i][::-1]  # a permuted slot order
            slots[i] = blk.experts[order].contiguous()
            m = torch.full((cfg.n_expert,), -1, dtype=torch.int32)
            m[order] = torch.arange(len(order), dtype=torch.int32)
            maps[i] = m.to(dev.device)

    def hybrid(i, r):
        y_gpu, _ = dev.layers.routed_experts(i, r, maps[i], slots[i])
        rest = ~torch.isin(r.ids.cpu(), torch.tensor(subsets[i]))
        y_ref, _ = moe_ffn_torch(host.blocks[i].experts, r.h.float().cpu(), r.ids.cpu(),
                                 r.weights.cpu() * rest, cfg.activation)  # fmt: skip
        return y_gpu + y_ref.to(y_gpu.device)

    ids = _ids(cfg.n_vocab, 8, seed=9)
    c1, c2 = dev.new_cache(8), dev.new_cache(8)
    for tokens in (ids[:6], ids[6:7], ids[7:]):
        want = dev.forward(tokens, c1)
        got = run_pieces(dev, tokens, c2, experts=hybrid)
        assert _max_err(got, want) <= 1e-5 * want.abs().max().item()


def test_bad_expert_maps_are_usage_errors(model):
    cfg, host = model
    dev = GpuExecutor(cfg, host, DEVICE)
    cache = dev.new_cache(4)
    with pytest.raises(UsageError, match="one entry per layer"):
        dev.forward([1], cache, expert_maps=[None])
    bad = [None] * cfg.n_layer
    bad[dev.moe_layers()[0]] = torch.zeros(cfg.n_expert, dtype=torch.int64)
    with pytest.raises(UsageError, match="int32"):
        dev.forward([1], cache, expert_maps=bad)


# -- decoding strategies on this executor ----------------------------------------------------


def test_big_little_decoding_runs_on_the_gpu_executor(tmp_path):
    """pyruntime.Model's big/little decoding over the GPU executor (k per call, routing traces,
    prefetch, rewinds): gamma = 0 is little-only decoding, gamma = 1 big-only, and greedy verify
    gives big-only's tokens, exactly (the same kernels on both sides)."""
    from pyruntime.api import Model

    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", num_experts_per_tok=4,
                            initializer_range=0.3)  # fmt: skip
    m = Model(convert(hf, tmp_path / "m.gguf", "f32", progress=False), n_ctx=64, device="cpu",
              expert_backend="torch", seed=0)  # fmt: skip
    m.net = GpuExecutor.from_gguf(m.file, DEVICE)

    def tokens(**decoding) -> list[int]:
        m.reset()
        stream = m.generate([5, 17, 300, 42, 9], max_tokens=8, temp=0.0, ignore_eos=True,
                            **decoding)  # fmt: skip
        list(stream)
        return stream.token_ids

    big, little = tokens(), tokens(experts_per_token=2)
    assert big != little  # the two models differ, so the equalities say something
    assert tokens(little_experts=2, fallback_threshold=0.0) == little
    assert tokens(little_experts=2, fallback_threshold=1.0) == big
    assert tokens(little_experts=2, fallback="verify", draft=3) == big
