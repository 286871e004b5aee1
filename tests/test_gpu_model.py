"""The device model (pyruntime.gpu.executor) vs the CPU reference model, every family.

Runs on device="cpu" here (the Triton kernels under TRITON_INTERPRET=1, the same code the GPU
runs, minus the CUDA graph); on a GPU machine the same tests also run on device="cuda" with the
decode step captured in a CUDA graph. Tolerances are the foundation's (tests/test_parity.py):
- f32 GGUF: max |d log-prob| <= 1e-3 against the CPU path, for a prefill and for prefill +
  token-by-token decode through the KV cache (decode: the split-K attention kernel);
- q8_0 GGUF (dense weights in bf16 on the device): argmax agreement >= 98% with the CPU path at
  the positions where the CPU path's top token leads the runner-up by >= 0.05 nats. bf16 moves a
  log-prob by <= 0.009 here (interpreter, every family), so a flip where the lead is under ~0.02
  measures a tie, not the kernels: the tiny random gpt-oss leads by under 0.05 nats at 52 of 64
  positions (median 0.022; on an H100 more than one of them flipped), the other families at 0-5.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from eager_graph import use_eager_graphs
from hf_fixtures import ARCHS, make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf
from pyruntime.gpu.executor import GpuExecutor

N_PREFILL, N_DECODE = 12, 4  # prefill > 8 tokens: the grouped-GEMM expert path
LOGPROB_TOL = 1e-3
ARGMAX_MARGIN = 0.05  # nats: a lead bf16 cannot overturn (module docstring)
# The Triton interpreter (CPU tensors) or compiled Triton on a GPU: one per process.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICES = ["cpu"] if INTERPRET else (["cuda"] if torch.cuda.is_available() else [])
DEVICE = DEVICES[0] if DEVICES else "cpu"


@pytest.fixture(scope="module", params=ARCHS)
def tiny_ggufs(request, tmp_path_factory) -> dict[str, Path | str]:
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"gpu-{arch}")
    # Tied embeddings: clear top-1 gaps, so argmax agreement measures quantization, not ties
    # (see tests/test_parity.py).
    hf_dir = make_tiny_hf_model(arch, tmp / "hf", tie_word_embeddings=True)
    out: dict[str, Path | str] = {"arch": arch}
    for fmt in ("f32", "q8_0"):
        out[fmt] = convert(hf_dir, tmp / f"m-{fmt}.gguf", fmt, progress=False)
    return out


def _ids(n_vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_vocab, (n,), generator=g).tolist()


def _logprobs(model, ids: list[int], split: int) -> torch.Tensor:
    """Prefill ids[:split], then decode the rest one token at a time."""
    cache = model.new_cache(len(ids))
    parts = [model.forward(ids[:split], cache)]
    parts += [model.forward(ids[j : j + 1], cache) for j in range(split, len(ids))]
    return torch.log_softmax(torch.cat(parts).double(), dim=-1)


def _models(path: Path, device: str, **gpu_options):
    f = open_gguf(path)
    return CpuExecutor.from_gguf(f, expert_backend="torch"), GpuExecutor.from_gguf(
        f, device, **gpu_options
    )


@pytest.mark.parametrize("device", DEVICES)
def test_f32_logprobs_match_cpu_path(tiny_ggufs, device):
    cpu, dev = _models(tiny_ggufs["f32"], device)
    assert dev.dtype == torch.float32
    ids = _ids(cpu.config.n_vocab, N_PREFILL + N_DECODE)
    ref = _logprobs(cpu, ids, N_PREFILL)
    got = _logprobs(dev, ids, N_PREFILL)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err <= LOGPROB_TOL, f"max |d log-prob| {err:.2e}"
    # Every position decoded (1-token steps from the empty cache): decode attention from n = 1.
    got_dec = _logprobs(dev, ids[:5], 1)
    err = (got_dec - ref[:5]).abs().max().item()
    assert err <= LOGPROB_TOL, f"decode-only max |d log-prob| {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_q8_0_argmax_agrees_with_cpu_path(tiny_ggufs, device):
    cpu, dev = _models(tiny_ggufs["q8_0"], device)
    assert dev.dtype == torch.bfloat16  # quantized dense weights: bf16 on the device
    # 64 positions as in tests/test_parity.py (one flip in 16 would already be 94%).
    ids = _ids(cpu.config.n_vocab, 64, seed=1)
    ref = _logprobs(cpu, ids, 64 - N_DECODE)
    got = _logprobs(dev, ids, 64 - N_DECODE)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= ARGMAX_MARGIN  # [64] positions that are no tie
    assert clear.sum() >= 10, "too few positions with a clear top token to judge agreement"
    agree = (got.argmax(-1) == ref.argmax(-1))[clear].double().mean().item()
    assert agree >= 0.98, f"argmax agreement {agree:.3f} over {int(clear.sum())} clear positions"


def test_sparse_threshold_matches_cpu_path(tiny_ggufs):
    """Per-layer thresholds: the kernels' sparse path vs the CPU reference's, and the achieved
    sparsity counted the same way. Three families: olmoe, gpt-oss (its thresholds on the
    biased, clamped gate: the "fused" kernel's bias path) and llama4 (thresholds on the gate of
    the routing-weighted input)."""
    if INTERPRET and tiny_ggufs["arch"] not in ("olmoe", "gptoss", "llama4"):
        pytest.skip("sparse path checked on olmoe, gpt-oss and llama4 only (interpreter time)")
    cpu, dev = _models(tiny_ggufs["f32"], DEVICE)
    thresholds = [0.05] * cpu.config.n_layer
    cpu.expert_threshold = thresholds
    dev.set_expert_threshold(thresholds)
    ids = _ids(cpu.config.n_vocab, 10, seed=2)
    ref = _logprobs(cpu, ids, 4)  # prefill of 4 tokens (<= SPARSE_MAX_BATCH) + decode
    got = _logprobs(dev, ids, 4)
    assert (got - ref).abs().max().item() <= LOGPROB_TOL
    assert dev.stats.neurons == cpu.stats.neurons
    assert 0.0 < cpu.stats.sparsity < 1.0
    assert abs(dev.stats.sparsity - cpu.stats.sparsity) < 1e-9


def test_context_full_is_a_usage_error(tiny_ggufs):
    from pyruntime.errors import UsageError

    if tiny_ggufs["arch"] != "olmoe":
        pytest.skip("family-independent")
    _, dev = _models(tiny_ggufs["f32"], DEVICE)
    cache = dev.new_cache(3)
    dev.forward([1, 2, 3], cache)
    with pytest.raises(UsageError, match="context is full"):
        dev.forward([4], cache)


@pytest.mark.parametrize(
    "content, reason",
    [(None, "cannot read it"), ("{not json", "cannot read it"), ("[1]", "object")],
)
def test_bad_tuning_file_is_a_usage_error(tiny_ggufs, tmp_path, content, reason):
    """A kernel tuning file that is missing, broken or not an object: one line when the model is
    built (saying which file), not a traceback in the middle of decoding."""
    if tiny_ggufs["arch"] != "olmoe":
        pytest.skip("family-independent")
    from pyruntime.errors import UsageError

    path = tmp_path / "tuned.json"
    if content is not None:
        path.write_text(content)
    want = f"kernel tuning file {re.escape(str(path))}: .*{reason}"
    with pytest.raises(UsageError, match=want):
        _models(tiny_ggufs["f32"], DEVICE, kernel_tuning=path)


def test_tuning_file_sets_the_launch_configs(tiny_ggufs, tmp_path):
    """The executor installs the tuning file it is given for the kernels (kernels.tuning), and
    the built-in defaults again when built without one."""
    if tiny_ggufs["arch"] != "olmoe":
        pytest.skip("family-independent")
    from pyruntime.kernels import tuning

    path = tmp_path / "tuned.json"
    path.write_text('{"router_block_e": 2, "q8_gemv": {"64x32": [2, 32, 1]}}')
    _models(tiny_ggufs["f32"], DEVICE, kernel_tuning=path)
    assert tuning.lookup("router_block_e") == 2 and tuning.lookup("q8_gemv", "64x32") == [2, 32, 1]
    _models(tiny_ggufs["f32"], DEVICE)
    assert tuning.lookup("router_block_e") is None


def test_decode_graph_captured_once_per_cache(tiny_ggufs, monkeypatch):
    """Decode steps replay one captured graph: capture runs once per cache and model state,
    not per token (a per-token capture costs ~15x the step). The capture is stood in for on the
    CPU by tests/eager_graph.py (replay reruns the step on the device inputs); the replayed
    logits equal eager decoding's."""
    if tiny_ggufs["arch"] != "olmoe":
        pytest.skip("family-independent")
    _, eager = _models(tiny_ggufs["f32"], DEVICE)
    _, dev = _models(tiny_ggufs["f32"], DEVICE)
    eager.cuda_graphs = False  # on CUDA both default to graphs; only dev's captures count
    captures = use_eager_graphs(monkeypatch, dev)
    cache, eager_cache = dev.new_cache(8), eager.new_cache(8)
    dev.forward([1, 2, 3], cache)
    eager.forward([1, 2, 3], eager_cache)
    for tok in (4, 5, 6):
        got, want = dev.forward([tok], cache), eager.forward([tok], eager_cache)
        # bit for bit under the interpreter; a GPU's atomics reorder float32 sums between runs
        assert torch.equal(got, want) if DEVICE == "cpu" else torch.allclose(got, want, atol=1e-4)
    assert len(captures) == 1
    dev.set_expert_threshold(None)  # a new model state: captured again on the next step
    dev.forward([7], cache)
    assert len(captures) == 2
    dev.forward([8], dev.new_cache(8))  # another cache: its own graph
    assert len(captures) == 3


@pytest.mark.parametrize("threshold", [None, 0.05])
def test_prompt_shapes_that_come_again_replay_a_graph(tiny_ggufs, monkeypatch, threshold):
    """A prompt pass of a shape seen before (tokens, first position, ...) is captured the second
    time and replayed from then on, on new token ids: its logits, the KV it writes (the decode
    step after it) and its expert counts equal eager passes', for a prompt at position 0 and a
    chunk after it, dense and sparse; a one-off shape is never captured; a new model state
    captures again. On a GPU the capture is CUDA's (every family's prefill must capture), on
    the CPU tests/eager_graph.py stands in (one family: the stand-in is the eager pass)."""
    if DEVICE == "cpu" and tiny_ggufs["arch"] != "olmoe":
        pytest.skip("on the CPU stand-in the policy is family-independent")
    _, eager = _models(tiny_ggufs["f32"], DEVICE)
    _, dev = _models(tiny_ggufs["f32"], DEVICE)
    eager.cuda_graphs = False
    captures = use_eager_graphs(monkeypatch, dev) if DEVICE == "cpu" else None
    for net in (eager, dev):
        net.set_expert_threshold(None if threshold is None else [threshold] * net.config.n_layer)
    n_vocab = dev.config.n_vocab
    cache, eager_cache = dev.new_cache(24), eager.new_cache(24)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        # bit for bit under the interpreter; a GPU's atomics reorder float32 sums between runs
        assert torch.equal(a, b) if DEVICE == "cpu" else torch.allclose(a, b, atol=1e-4)

    for seed in range(3):
        prompt, chunk = _ids(n_vocab, 12, seed), _ids(n_vocab, 5, 10 + seed)
        cache.truncate(0)
        eager_cache.truncate(0)
        for ids, last_only in ((prompt, False), (chunk, True), ([7], False)):
            same(dev.forward(ids, cache, last_only), eager.forward(ids, eager_cache, last_only))
    state = cache.executor_state["gpu"]
    assert sorted(key[:2] for key in state.prefills) == [(5, 12), (12, 0)]
    assert dev.stats.pairs == eager.stats.pairs and dev.stats.active == eager.stats.active
    if captures is not None:
        assert len(captures) == 3  # the two prompt shapes and the decode step
    dev.forward(_ids(n_vocab, 9), dev.new_cache(24))  # once: eager, not kept
    cache.truncate(0)
    dev.set_expert_threshold(None)  # a new model state: the known shape is captured again
    dev.forward(_ids(n_vocab, 12), cache)
    assert all(key[0] != 9 for key in state.prefills)
    if captures is not None:
        assert len(captures) == 4


def test_profiled_switch_says_once_that_it_times_the_layers(tiny_ggufs, tmp_path, monkeypatch,
                                                            capsys):  # fmt: skip
    """The per-layer dense/sparse profile (run on CUDA by set_expert_threshold with a key; here
    with a stand-in timer): one stderr line when it profiles, none when the cache answers."""
    if tiny_ggufs["arch"] != "olmoe":
        pytest.skip("one family is enough")
    from pyruntime.kernels import switch

    monkeypatch.setattr(switch, "INPUTS_PER_BATCH", 1)
    switch._MEMO.clear()
    calls = []

    def fake_timer(reps: int = 20):
        def timer(path, batch, fn):
            calls.append((path, batch))
            return {"dense": 2.0, "sparse": 1.0 if batch <= 2 else 3.0}[path]

        return timer

    monkeypatch.setattr(switch, "graph_timer", fake_timer)
    _, dev = _models(tiny_ggufs["f32"], DEVICE)
    dev.set_expert_threshold([0.05] * dev.config.n_layer)
    got = dev.layers.profiled_switch("tiny/s0.5", tmp_path)
    assert got == [switch.SparseSwitch((1, 2, 4, 8), (1, 2))] * dev.config.n_layer
    err = capsys.readouterr().err
    assert err.count("timing dense vs sparse experts") == 1 and str(tmp_path) in err
    n_timed = len(calls)
    switch._MEMO.clear()
    assert dev.layers.profiled_switch("tiny/s0.5", tmp_path) == got  # from the cache files
    assert len(calls) == n_timed and capsys.readouterr().err == ""
