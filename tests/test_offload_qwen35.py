"""The hybrid executor (pyruntime.offload) on Qwen3.5-MoE: Gated DeltaNet layers with their
recurrent state on the device beside the routed experts split between GPU slots and the C core,
with torch's CPU device standing in for the GPU as in tests/test_offload.py.

The tiny model has 3 DeltaNet layers and 1 full-attention layer, each with 8 routed experts
(top-2 here) and a shared expert behind its sigmoid gate. Its logits equal the GPU executor's
with the whole model resident (|d log-prob| <= 1e-3, the CPU's experts being the C core's; bit
for bit where only the GPU computes) for every budget and placement, dense and sparse; a
captured decode step advances the recurrent state once; a Session's snapshots and rewinds
behave as on the whole-GPU model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_fixtures import make_tiny_hf_model
from test_offload import (
    DEVICE,
    LOGPROB_TOL,
    N_DECODE,
    N_PROMPT,
    SAME_KERNELS_TOL,
    check_sparse_experts_match,
    even_costs,
    hybrid,
    ids_of,
    logprobs,
    max_err,
    n_routed,
)

from pyruntime.converter import convert
from pyruntime.decoding.session import Session
from pyruntime.errors import UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.gpu import cache_state
from pyruntime.gpu.executor import GpuExecutor
from pyruntime.model.config import ModelConfig
from pyruntime.model.weights import HostWeights
from pyruntime.offload import executor as offload_executor
from pyruntime.offload.segments import DecodeSegments


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload-qwen35")
    hf_dir = make_tiny_hf_model("qwen35moe", tmp / "hf", num_experts_per_tok=2)
    f = open_gguf(convert(hf_dir, tmp / "m.gguf", "f32", progress=False))
    cfg = ModelConfig.from_gguf(f)
    return f, cfg, HostWeights.from_gguf(f, cfg)


@pytest.fixture(scope="module")
def whole(qwen35):
    """The GPU executor's log-probs with every expert resident (torch on one thread, as the
    hybrid sets it: see tests/test_offload.py's `whole`)."""
    torch.set_num_threads(1)
    _, cfg, host = qwen35
    ids = ids_of(cfg, N_PROMPT + N_DECODE)
    return ids, logprobs(GpuExecutor(cfg, host, DEVICE), ids)


def test_the_model_has_deltanet_layers_and_a_gated_shared_expert(qwen35):
    _, cfg, host = qwen35
    assert cfg.recurrent_layers == (True, True, True, False)
    assert all(b.experts is not None and b.shared_gate is not None for b in host.blocks)


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
@pytest.mark.parametrize("slots", [0, 1, 5, "all"])
def test_logits_equal_the_whole_model_on_the_gpu(qwen35, core, whole, slots, misses):
    _, cfg, host = qwen35
    slots = n_routed(cfg, host) if slots == "all" else slots
    net = hybrid(qwen35, core, slots, misses)
    ids, want = whole
    got = logprobs(net, ids)
    st = net.offload_stats()
    assert max_err(got, want) <= LOGPROB_TOL
    if slots == 0 or misses == "cpu":
        assert st["staged_experts"] == 0 and st["cpu_experts"] > 0
    elif misses == "stage" and slots == n_routed(cfg, host):
        assert st["cpu_experts"] == 0
        assert max_err(got, want) <= SAME_KERNELS_TOL  # only the GPU's kernels, as resident
    elif misses == "auto" and slots >= 5 and net.experts.slots_keep:  # a cache: all staged
        assert st["cpu_experts"] == 0 and st["staged_experts"] > 0
    elif misses == "auto" and slots >= 5:  # transit slots
        assert st["cpu_experts"] > 0 and st["staged_experts"] > 0  # a split
    assert net.stats.pairs == (N_PROMPT + N_DECODE) * cfg.n_expert_used * cfg.n_layer


@pytest.mark.parametrize("misses", ["cpu", "stage", "auto"])
def test_sparse_experts_match_on_both_sides(qwen35, core, misses):
    check_sparse_experts_match(qwen35, core, 5, misses, (0.1, 0.95))


# -- captured segments ---------------------------------------------------------------------------


class EagerGraph:
    """A captured segment stood in on the CPU: replay() reruns it and writes its results into
    the tensors the capture returned (as tests/eager_graph.py does for the whole step)."""

    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs

    def replay(self) -> None:
        with torch.inference_mode():
            out = self.fn()
        if out is None:
            return
        for field in dataclasses.fields(out):
            getattr(self.outputs, field.name).copy_(getattr(out, field.name))


def capture_segments(monkeypatch) -> list[int]:
    """Make the hybrid's decode steps captured segments, stood in by EagerGraph (the capture's
    warm-up run included); returns the list that gets one entry per capture."""
    captures: list[int] = []

    def capture(fn, device, pool=None):
        captures.append(1)
        outputs = fn()  # the warm-up run
        return EagerGraph(fn, outputs), outputs

    class Captured(DecodeSegments):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.capture = True

    monkeypatch.setattr(cache_state, "capture", capture)
    monkeypatch.setattr(offload_executor, "DecodeSegments", Captured)
    return captures


def test_a_captured_segment_advances_the_recurrent_state_once(qwen35, core, whole, monkeypatch):
    """The capture's warm-up run of a segment advances its DeltaNet layers' states; the
    segments put them back, so the replayed step equals the eager one (misses staged: auto
    in transit slots decodes through the direct step's one graph instead)."""
    captures = capture_segments(monkeypatch)
    net = hybrid(qwen35, core, 5, "stage")
    ids, want = whole
    assert max_err(logprobs(net, ids), want) <= LOGPROB_TOL
    moe = len(net.moe_layers())
    assert len(captures) >= moe + 1  # the step's segments (and the GPU's experts) captured


# -- sessions: snapshots and rewinds --------------------------------------------------------------


def _session_logits(net, ids: list[int]) -> list[torch.Tensor]:
    """A fixed sequence of prompts, feeds and rewinds (each reuse or restart is the cache's
    recurrent state going back to a snapshot, or to 0)."""
    out = []
    s = Session(net, 40)
    out.append(s.prefill(ids[:12])[0])  # a prompt: its state kept at 12
    out += [s.feed(t) for t in ids[12:14]]
    logits, evaluated = s.prefill(ids[:18])  # the cache's 14 tokens are a prefix: it goes on
    assert evaluated == 4
    out.append(logits)
    s.feed(ids[18])
    s.rewind(1)  # back to the prompt's end: its snapshot
    assert s.cache.n_tokens == len(s.ids) == 18
    out.append(s.feed(ids[19]))
    out.append(s.prefill(ids[:12] + [7, 8])[0])  # diverges after 12: no snapshot, from 0
    s.feed(ids[0])
    with pytest.raises(UsageError, match="recurrent .DeltaNet. state"):
        s.rewind(2)  # position 13: no snapshot, the session starts over
    assert s.cache.n_tokens == len(s.ids) == 0
    out.append(s.prefill(ids[:5])[0])
    return out


@pytest.mark.parametrize("slots", [0, 5])
def test_session_snapshots_and_rewinds_as_on_the_gpu(qwen35, core, slots):
    _, cfg, host = qwen35
    ids = ids_of(cfg, 20, seed=2)
    want = _session_logits(GpuExecutor(cfg, host, DEVICE), ids)
    got = _session_logits(hybrid(qwen35, core, slots, "auto"), ids)
    for a, b in zip(got, want, strict=True):
        assert max_err(torch.log_softmax(a, -1), torch.log_softmax(b, -1)) <= LOGPROB_TOL


def test_big_little_prompt_fallback_through_the_hybrid(tmp_path, qwen35, core):
    """big/little's prompt fallback rewinds the whole prompt (the recurrent state back to 0)
    and redoes it with the big k: the same tokens as the whole-GPU model's."""
    from pyruntime.api import Model

    f, cfg, host = qwen35
    m = Model(f.path, n_ctx=32, device="cpu", expert_backend="torch", seed=0)

    def tokens(net, **decoding) -> list[int]:
        m.net, m._session = net, None
        stream = m.generate([5, 17, 300, 42, 9], max_tokens=1, temp=0.0, ignore_eos=True,
                            **decoding)  # fmt: skip
        list(stream)
        return stream.token_ids

    net = hybrid(qwen35, core, 5, "auto", costs=even_costs(host))
    resident = GpuExecutor(cfg, host, DEVICE)
    for decoding in ({}, dict(little_experts=1, fallback_threshold=1.0)):
        assert tokens(net, **decoding) == tokens(resident, **decoding), decoding
    assert net.offload.prefetched > 0  # the fallback's prefetch staged experts
