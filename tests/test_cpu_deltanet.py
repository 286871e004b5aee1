"""The C core's Gated DeltaNet decode step (pyrt_deltanet_step, pyruntime.cpu.deltanet) against
the torch reference (pyruntime.model.deltanet) on the tiny Qwen3.5-MoE: per layer from a random
state (the recurrent form), token by token against the chunked form of a prompt, and the CPU
executor's logits with its DeltaNet decode steps in C against the reference model's; plus the C
unit tests under ASan + UBSan (tests/c/test_deltanet.c).

Tolerances: F32 weights, float32 math in a different order: 1e-5 on a layer's output (values
~1e-1), 1e-4 on log-probs. Q8_0: the reference's matrices run on the C core too (the same
quantized x), so the same tolerances hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_fixtures import make_tiny_hf_model
from sanitized_c import run_sanitized_c_test

from pyruntime.converter import convert
from pyruntime.cpu.core import CoreError
from pyruntime.cpu.deltanet import CDeltaNet
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf
from pyruntime.model import deltanet
from pyruntime.model.config import ModelConfig
from pyruntime.model.weights import HostWeights


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model("qwen35moe", tmp_path_factory.mktemp("cdn") / "hf")


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def model(request, hf_dir, tmp_path_factory):
    path = convert(hf_dir, tmp_path_factory.mktemp("cdn") / "m.gguf", request.param,
                   progress=False)  # fmt: skip
    f = open_gguf(path)
    cfg = ModelConfig.from_gguf(f)
    return f, cfg, HostWeights.from_gguf(f, cfg)


def _linear(core):
    def linear(x, w, bias=None):
        return core.linear(w.raw, int(w.qtype), w.shape[0], w.shape[1], x, bias)

    return linear


def _states(cfg, seed: int):
    g = torch.Generator().manual_seed(seed)
    C, K = cfg.ssm_conv_channels, cfg.ssm_conv_kernel
    conv = torch.randn(C, K - 1, generator=g)
    ssm = torch.randn(cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim, generator=g)
    return conv, ssm * 0.3


def test_one_step_per_layer_equals_the_recurrent_form(model, core):
    f, cfg, host = model
    c = CDeltaNet(cfg, host, core)
    layers = [i for i in range(cfg.n_layer) if cfg.is_recurrent(i)]
    assert layers == [0, 1, 2]
    g = torch.Generator().manual_seed(5)
    for i in layers:
        w = host.blocks[i].deltanet
        conv, ssm = _states(cfg, i)
        rconv, rssm = conv.clone(), ssm.clone()
        for _ in range(4):
            x = torch.randn(1, cfg.n_embd, generator=g)
            y = c.step(i, x, conv, ssm)
            want = deltanet.deltanet_layer(cfg, w, x, rconv, rssm, _linear(core), use_chunked=False)
            assert (y - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
            assert torch.equal(conv, rconv)
            assert (ssm - rssm).abs().max() <= 1e-5 * rssm.abs().max()


def test_token_by_token_equals_the_chunked_prompt(model, core):
    """Steps from a zero state over a prompt equal the chunked form over it (outputs and the
    final state): the prefill and decode forms agree across the C boundary."""
    f, cfg, host = model
    c = CDeltaNet(cfg, host, core)
    w = host.blocks[1].deltanet
    x = torch.randn(70, cfg.n_embd, generator=torch.Generator().manual_seed(1))  # 2 chunks
    C, K = cfg.ssm_conv_channels, cfg.ssm_conv_kernel
    zero = (torch.zeros(C, K - 1), torch.zeros(cfg.ssm_n_v_heads, cfg.ssm_head_k_dim,
                                              cfg.ssm_head_v_dim))  # fmt: skip
    rconv, rssm = (t.clone() for t in zero)
    want = deltanet.deltanet_layer(cfg, w, x, rconv, rssm, _linear(core), use_chunked=True)
    conv, ssm = (t.clone() for t in zero)
    got = torch.cat([c.step(1, x[t : t + 1], conv, ssm) for t in range(x.shape[0])])
    scale = want.abs().max().item()
    assert (got - want).abs().max() <= 1e-4 * scale
    assert torch.equal(conv, rconv)
    assert (ssm - rssm).abs().max() <= 1e-4 * rssm.abs().max()


def test_cpu_executor_decodes_deltanet_layers_in_c(model, core, monkeypatch):
    """The CPU executor with the C core: a prompt (chunked, torch) then decode steps whose
    DeltaNet layers are C calls (the torch recurrent form is not called), with the log-probs of
    the same executor running them in torch (its matrices and experts on the C core alike)."""
    f, cfg, host = model
    ids = torch.randint(0, cfg.n_vocab, (12,), generator=torch.Generator().manual_seed(4))
    ref = CpuExecutor.from_gguf(f, expert_backend="c")
    ref._deltanet_c = None  # the reference's torch forms for the DeltaNet layers
    net = CpuExecutor.from_gguf(f, expert_backend="c")
    assert net._deltanet_c is not None

    def run(m):
        cache = m.new_cache(len(ids))
        out = [m.forward(ids[:6], cache)]
        out += [m.forward(ids[j : j + 1], cache) for j in range(6, len(ids))]
        return torch.log_softmax(torch.cat(out).double(), -1), cache

    want, ref_cache = run(ref)
    calls = []
    real = net._deltanet_c.step
    monkeypatch.setattr(net._deltanet_c, "step", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setattr(deltanet, "recurrent", None)  # the torch decode form is not used
    got, cache = run(net)
    assert calls == [0, 1, 2] * 6
    assert (got - want).abs().max() <= 1e-4
    for i in (0, 1, 2):
        assert (cache.recurrent.ssm[i] - ref_cache.recurrent.ssm[i]).abs().max() <= 1e-4


def test_bad_calls_are_one_line_errors(model, core):
    f, cfg, host = model
    c = CDeltaNet(cfg, host, core)
    conv, ssm = _states(cfg, 0)
    x = torch.zeros(1, cfg.n_embd)
    with pytest.raises(CoreError, match=r"^pyrt_deltanet_step: ssm_state holds \d+ floats"):
        c.step(0, x, conv, ssm[:-1].contiguous())
    with pytest.raises(CoreError, match="conv_state must be a contiguous float32 CPU tensor"):
        c.step(0, x, conv.t(), ssm)
    with pytest.raises(CoreError, match=r"x has shape \(2, "):
        c.step(0, torch.zeros(2, cfg.n_embd), conv, ssm)


def test_c_deltanet_tests_under_asan_ubsan(tmp_path):
    """tests/c/test_deltanet.c: the step against float64 and its error paths under ASan + UBSan
    + LSan."""
    run_sanitized_c_test(tmp_path, "test_deltanet", "all C deltanet tests passed")
