"""The C core's prefill (pyrt_decoder_prefill through CpuExecutor.forward for several tokens)
against token-by-token decoding with the C step.

On tiny random models of every family but qwen35moe and deepseek2 (tests/hf_fixtures; gpt-oss's
with sinks, a sliding window of 8 on layer 0, YaRN, o, router and expert biases and the clamped
SwiGLU), converted to F32, Q8_0 and Q4_0:
prompts of 1, 7, 33 and 300 tokens, in chunks (--ubatch) that split them unevenly (and the
default), from an empty cache and after earlier tokens, dense and with sparsity thresholds: the
prefill's log-probabilities of every position vs those of one C step per token, max |difference|
<= 1e-5 (the prefill and the step make the same operations per token, the routed experts' sums
in another order: f32 rounding through the blocks measures ~1e-6; a wrong position, mask, chunk
seam or expert is >= 1e-3). The step itself is checked against the torch reference in
tests/test_cpu_decode.py.

Also: what forward returns (every row, or the last one), the routing trace, k, expert maps, the
counts in stats, --ubatch through the options, and tests/c/test_prefill.c under ASan + UBSan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_fixtures import ARCHS, make_tiny_hf_model
from sanitized_c import run_sanitized_c_test

from pyruntime.converter import convert
from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf
from pyruntime.model.executor import RoutingTrace

LOGPROB_TOL = 1e-5
# gpt-oss's tiny model with quantized weights: its exercised weights (gate/up biases ~N(0, 1),
# sinks of a few units) make |h| up to ~30, so where the f32 order of the sums moves an
# activation across a Q8 rounding step, one position's log-probabilities move by ~1e-5 (measured
# 1.05e-5, one position of 300, q4_0 sparse); a missing sink, window, YaRN factor or bias is
# >= 1e-2.
LOGPROB_TOL_GPTOSS_QUANT = 5e-5
# llama4 on quantized weights: the routing weight multiplies the expert's input, which is then
# quantized to Q8 blocks, so a 1-ulp move of a router logit (the prefill's GEMM sums in another
# order than a step's matvec) moves the Q8 rounding of the whole input: isolated rows move by up
# to 1.5e-3 (3 of 300 rows, q4_0 dense; the other families weight the experts' outputs). A wrong
# mask, chunk, temperature or weight moves every row past LOGPROB_TOL, so: at most 2% of the
# rows (one of a short prompt) past it, none past 1e-2.
LLAMA4_SPIKES, LOGPROB_TOL_LLAMA4_QUANT = 0.02, 1e-2
SPARSE = 0.02  # a threshold that skips part of the tiny models' neurons (checked below)


# every forward pass of qwen35moe takes the reference path (its Gated DeltaNet layers are not in
# the C core: tests/test_qwen35.py); deepseek2's latent attention is mla_prefill.c, llama4's
# layers llama4.c
C_PREFILL_ARCHS = [a for a in ARCHS if a != "qwen35moe"]


@pytest.fixture(scope="module", params=C_PREFILL_ARCHS)
def hf_model(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_hf_model(arch, tmp_path_factory.mktemp(f"hf-{arch}"))


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    """outtype -> the GGUF of the module's model in that format (made once)."""
    arch, hf_dir = hf_model
    out = tmp_path_factory.mktemp(f"gguf-{arch}")
    paths: dict[str, Path] = {}

    def get(outtype: str) -> Path:
        if outtype not in paths:
            paths[outtype] = convert(hf_dir, out / f"{outtype}.gguf", outtype, progress=False)
        return paths[outtype]

    return get


def load(path: Path, ubatch: int | None = None, threads: int = 2) -> CpuExecutor:
    c = CpuExecutor.from_gguf(open_gguf(path), threads=threads, expert_backend="c",
                              ubatch=ubatch)  # fmt: skip
    assert c._decoder is not None
    return c


def prompt(n_vocab: int, n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, n_vocab, (n,), generator=torch.Generator().manual_seed(seed))


def by_steps(c: CpuExecutor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [n, n_vocab] of one C step per token."""
    cache = c.new_cache(len(ids))
    rows = [c.forward(ids[j : j + 1], cache) for j in range(len(ids))]
    return torch.log_softmax(torch.cat(rows), dim=-1)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = LOGPROB_TOL,
                 spikes: bool = False) -> None:  # fmt: skip
    """Every row within tol; with `spikes` (llama4 on quantized weights, LLAMA4_SPIKES) a few
    isolated rows may reach LOGPROB_TOL_LLAMA4_QUANT."""
    rows = (a - b).abs().amax(dim=-1)
    err = rows.max().item()
    if spikes:
        far = int((rows > tol).sum())
        assert far <= max(1, LLAMA4_SPIKES * len(rows)) and err <= LOGPROB_TOL_LLAMA4_QUANT, (
            f"{what}: {far} of {len(rows)} rows past {tol}, max |d logprob| {err:.3g}"
        )
        return
    assert err <= tol, f"{what}: max |d logprob| {err:.3g} > {tol}"


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_prefill_is_token_by_token_decoding(converted, hf_model, outtype, sparse):
    """Prompts of 1, 7, 33, 300 tokens in one forward, in chunks of 16 (33 = 2 x 16 + 1,
    300 = 18 x 16 + 12) and of the default size; 300 also after 37 earlier tokens (chunks
    then start mid-cache)."""
    c = load(converted(outtype), ubatch=16)
    cfg = c.config
    tol = LOGPROB_TOL_GPTOSS_QUANT if hf_model[0] == "gptoss" and outtype != "f32" else LOGPROB_TOL
    spikes = hf_model[0] == "llama4" and outtype != "f32"
    if sparse:
        c.expert_threshold = [SPARSE] * cfg.n_layer
    ids = prompt(cfg.n_vocab, 337)
    # the reference steps on one thread: a step's routed experts sum per-thread partial outputs
    # (moe_ffn.c), so its f32 rounding moves with the thread count (~1e-6), and on quantized
    # weights such a move can cross a Q8 rounding step of the next layer's input (~1e-3, as a bug
    # would); the prefill's sums do not depend on the thread count.
    ref = load(converted(outtype), threads=1)
    if sparse:
        ref.expert_threshold = [SPARSE] * cfg.n_layer
    steps = by_steps(ref, ids)
    for n in (1, 7, 33, 300):
        for ubatch in (16, None):
            c.ubatch = ubatch
            c.stats.reset()
            cache = c.new_cache(n)
            got = torch.log_softmax(c.forward(ids[:n], cache), dim=-1)
            assert cache.n_tokens == n
            assert_close(
                got, steps[:n], f"{hf_model[0]} {outtype} n={n} ubatch={ubatch}", tol, spikes
            )
            moe = sum(blk.experts is not None for blk in c.weights.blocks)
            assert c.stats.pairs == n * moe * cfg.n_expert_used
            if sparse:
                assert 0.0 < c.stats.sparsity < 1.0
            else:
                assert c.stats.sparsity == 0.0
    c.ubatch = 16
    cache = c.new_cache(337)
    c.forward(ids[:37], cache)
    got = torch.log_softmax(c.forward(ids[37:], cache), dim=-1)
    assert_close(got, steps[37:], f"{hf_model[0]} {outtype}: 300 tokens after 37", tol, spikes)


def test_last_only_is_the_last_row(converted):
    c = load(converted("q8_0"), ubatch=5)
    ids = prompt(c.config.n_vocab, 12)
    every = c.forward(ids, c.new_cache(12))
    last = c.forward(ids, c.new_cache(12), last_only=True)
    assert every.shape == (12, c.config.n_vocab) and last.shape == (1, c.config.n_vocab)
    assert torch.equal(last[0], every[-1])


def test_routing_k_and_maps_through_the_prefill(converted, hf_model):
    """forward's routing trace is the last token's (as its step's), k routes that many experts
    (the step's logits with that k), identity expert maps change no bit and a map that sends
    every expert elsewhere computes no pair here."""
    c = load(converted("f32"), ubatch=4)
    cfg, dec = c.config, c._decoder
    ids = prompt(cfg.n_vocab, 10)
    trace_pre, trace_step = RoutingTrace([]), RoutingTrace([])
    c.forward(ids, c.new_cache(10), routing=trace_pre)
    cache = c.new_cache(10)
    c.forward(ids[:9], cache)
    c.forward(ids[9:], cache, routing=trace_step)
    assert trace_pre.layers == trace_step.layers == c.moe_layers()
    assert torch.equal(trace_pre.ids, trace_step.ids)
    assert (trace_pre.logits - trace_step.logits).abs().max() <= 1e-4

    k = 1 if cfg.n_expert_used > 1 else 2
    cache = c.new_cache(10)
    steps = []
    for j in range(10):
        cache.reserve(1)
        steps.append(dec.step(int(ids[j]), cache, k=k)[0])
    got = torch.log_softmax(c.forward(ids, c.new_cache(10), k=k), dim=-1)
    assert_close(got, torch.log_softmax(torch.cat(steps), dim=-1), f"{hf_model[0]} k={k}")

    plain, _ = dec.prefill(ids.int(), _reserved(c, 10), all_logits=True)
    ident = [torch.arange(cfg.n_expert, dtype=torch.int32)] * cfg.n_layer
    mapped, _ = dec.prefill(ids.int(), _reserved(c, 10), all_logits=True, expert_maps=ident)
    assert torch.equal(plain, mapped)
    none = [torch.full((cfg.n_expert,), -1, dtype=torch.int32)] * cfg.n_layer
    dec.prefill(ids.int(), _reserved(c, 10), expert_maps=none)
    assert dec.n_pairs == 0


def _reserved(c: CpuExecutor, n: int):
    cache = c.new_cache(n)
    cache.reserve(n)
    return cache


def test_the_calibration_observer_takes_the_reference_path(converted):
    c = load(converted("f32"))
    seen = []
    c.gate_observer = lambda i, store, x, ids, act: seen.append(i)
    ids = prompt(c.config.n_vocab, 6)
    c.forward(ids, c.new_cache(6))
    assert sorted(set(seen)) == c.moe_layers()  # the observer saw every MoE layer's inputs


def test_prefill_refuses_bad_arguments(converted):
    c = load(converted("q8_0"))
    cache = c.new_cache(4)
    cache.reserve(4)
    with pytest.raises(cpu_core.CoreError, match="token 4096 is outside"):
        c._decoder.prefill(torch.tensor([1, 4096], dtype=torch.int32), cache)
    with pytest.raises(cpu_core.CoreError, match="outside the cache"):
        c._decoder.prefill(torch.zeros(5, dtype=torch.int32), cache)
    with pytest.raises(cpu_core.CoreError, match="ubatch=-2 must be >= 0"):
        c._decoder.prefill(torch.zeros(2, dtype=torch.int32), cache, ubatch=-2)
    assert cache.n_tokens == 0  # nothing advanced by the refused calls


def test_ubatch_option_reaches_the_executor(tmp_path):
    from pyruntime.api import Model
    from pyruntime.errors import UsageError

    hf_dir = make_tiny_hf_model("olmoe", tmp_path / "hf")
    path = convert(hf_dir, tmp_path / "m.gguf", "q8_0", progress=False)
    m = Model(path, device="cpu", ubatch=8, n_ctx=64)
    assert m.net.ubatch == 8
    with pytest.raises(UsageError, match=r"ubatch must be in \[1, 2\^31\), got 0"):
        Model(path, device="cpu", ubatch=0)


# ---- C unit tests under sanitizers ----------------------------------------------------------


def test_c_prefill_tests_under_asan_ubsan(tmp_path):
    """tests/c/test_prefill.c: the prefill's paths and errors under ASan + UBSan + LSan."""
    run_sanitized_c_test(tmp_path, "test_prefill", "all C prefill tests passed")
