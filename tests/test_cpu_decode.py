"""The C core's dense-weight kernel (pyrt_linear) and whole-model decode step (pyrt_decoder_step).

pyrt_linear vs a float64 PyTorch reference, every weight format, odd shapes, 1..70 tokens, 1..3
threads, every SIMD level of this CPU. The reference uses exactly the numbers the kernel reads
(weights dequantized by gguf, exact in f32; for Q8_0/Q4_0 the activation quantized to Q8_0 blocks
as the kernel does), so what is left is f32 rounding of one dot product plus the bias add:
|y - ref| <= (n_in + 2) u sum_i |w_i x_i| + u |ref|  (u = 2^-24), far below any real bug.

The decode step vs the torch path, on tiny random models of every family (tests/hf_fixtures)
converted to every format, after a prefill (so the step reads a cache that prefill wrote):
- float weights (F32, F16, BF16): step logits vs the torch reference decoding token by token;
- every format: step logits vs the C-core prefill of the same tokens (which quantizes activations
  the same way), so Q8_0/Q4_0 are checked op for op too.
Both in log-probabilities, max |difference| <= 1e-5: f32 rounding through two blocks measures
~1e-6, while a wrong RoPE pair, a missing bias or norm, or a wrong expert is >= 1e-3.

tests/c/test_decode.c runs every decode and error path of the C side under ASan + UBSan.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hf_fixtures import ARCHS, make_tiny_hf_model
from quant_blocks import K_QUANTS, quantize_x_q8k_ref, random_blocks
from sanitized_c import run_sanitized_c_test
from test_cpu_core import FORMATS, QUANTIZED, default_n_embd

from pyruntime.converter import convert
from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf
from pyruntime.kernels.expert_formats import quantize_x_q8_ref

U = 2.0**-24
Q = gguf.GGMLQuantizationType
LOGPROB_TOL = 1e-5


# ---- pyrt_linear ----------------------------------------------------------------------------


def make_matrix(fmt: str, n_out: int, n_in: int, gen: torch.Generator):
    """(raw bytes as stored [n_out, row_bytes], float64 values [n_out, n_in])."""
    w = (torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).numpy()
    if fmt in K_QUANTS:  # gguf-py has no K-quant quantizer: random blocks of that size
        rng = np.random.default_rng(int(torch.randint(2**31, (1,), generator=gen)))
        raw = random_blocks(FORMATS[fmt], n_out, n_in, rng, scale=3 * n_in**-0.5)
    else:
        raw = gguf.quants.quantize(w, FORMATS[fmt])
    values = gguf.quants.dequantize(raw, FORMATS[fmt]).astype(np.float64)
    return np.ascontiguousarray(raw), torch.from_numpy(values)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n_tokens", [1, 7, 70])
@pytest.mark.parametrize("threads", [1, 3])
def test_linear_matches_reference(simd, fmt, n_tokens, threads):
    gen = torch.Generator().manual_seed(hash((fmt, n_tokens, threads)) % 2**31)
    n_out = 37  # odd: one row left after the row pairs
    n_in = default_n_embd(fmt)  # 3 blocks; 83 = 2*32 + 16 + 3 (every tail path)
    raw, w = make_matrix(fmt, n_out, n_in, gen)
    x = torch.randn(n_tokens, n_in, generator=gen)
    bias = torch.randn(n_out, generator=gen)
    with cpu_core.CpuCore(threads) as core:
        y = core.linear(raw, int(FORMATS[fmt]), n_out, n_in, x, bias)
        y_nobias = core.linear(raw, int(FORMATS[fmt]), n_out, n_in, x)
    xk = (
        quantize_x_q8k_ref(x)
        if fmt in K_QUANTS
        else quantize_x_q8_ref(x)
        if fmt in QUANTIZED
        else x.double()
    )
    ref = xk @ w.T
    bound = (n_in + 2) * U * (xk.abs() @ w.abs().T) + U * (ref.abs() + bias.abs().double())
    assert ((y_nobias.double() - ref).abs() <= bound).all()
    ref_b = ref + bias.double()
    assert ((y.double() - ref_b).abs() <= bound + U * ref_b.abs()).all()


def test_linear_invalid_arguments_raise_with_the_c_message():
    raw, _ = make_matrix("Q8_0", 8, 64, torch.Generator().manual_seed(0))
    x = torch.randn(2, 64)
    with cpu_core.CpuCore(2) as core:
        with pytest.raises(cpu_core.CoreError, match="holds 544 bytes but \\[9, 64\\]"):
            core.linear(raw, int(Q.Q8_0), 9, 64, x)
        with pytest.raises(cpu_core.CoreError, match="unknown weight format 3"):
            core.linear(raw, 3, 8, 64, x)  # Q4_1: not read
        f32 = np.zeros((8, 40), dtype=np.float32)
        with pytest.raises(cpu_core.CoreError, match="not a multiple of 32"):
            core.linear(f32.view(np.uint8), int(Q.Q8_0), 8, 40, torch.zeros(1, 40))
        with pytest.raises(cpu_core.CoreError, match="shape mismatch"):
            core.linear(raw, int(Q.Q8_0), 8, 64, torch.zeros(1, 63))
        assert core.linear(raw, int(Q.Q8_0), 8, 64, torch.zeros(0, 64)).shape == (0, 8)


# ---- decode step ----------------------------------------------------------------------------


# The families the C decode step runs (deepseek2's latent attention: runtime/src/mla_step.c;
# llama4's NoPE / chunked layers and input-weighted experts: runtime/src/llama4.c): qwen35moe's
# Gated DeltaNet layers are not in the C core, so its forward passes take the reference path
# (CpuExecutor.c_decoder_runs; tests/test_qwen35.py)
C_DECODER_ARCHS = [a for a in ARCHS if a != "qwen35moe"]


@pytest.fixture(scope="module", params=C_DECODER_ARCHS)
def hf_model(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_hf_model(arch, tmp_path_factory.mktemp(f"hf-{arch}"))


def load(path: Path, backend: str) -> CpuExecutor:
    return CpuExecutor.from_gguf(open_gguf(path), expert_backend=backend)


def decode_logprobs(model: CpuExecutor, ids: torch.Tensor, split: int, cache=None):
    """Prefill ids[:split], then one forward per token; log-probs of the decoded positions."""
    cache = model.new_cache(len(ids)) if cache is None else cache
    model.forward(ids[:split], cache)
    logits = torch.cat([model.forward(ids[j : j + 1], cache) for j in range(split, len(ids))])
    return torch.log_softmax(logits, dim=-1)


def prompt(n_vocab: int, n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, n_vocab, (n,), generator=torch.Generator().manual_seed(seed))


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = (a - b).abs().max().item()
    assert err <= LOGPROB_TOL, f"{what}: max |d logprob| {err:.3g} > {LOGPROB_TOL}"


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "mxfp4"])
def test_decode_step_matches_torch_path(hf_model, outtype, tmp_path):
    arch, hf_dir = hf_model
    path = convert(hf_dir, tmp_path / f"{arch}-{outtype}.gguf", outtype, progress=False)
    c = load(path, "c")
    assert c._decoder is not None
    ids = prompt(c.config.n_vocab)
    split = 8
    step = decode_logprobs(c, ids, split)
    prefill = torch.log_softmax(c.forward(ids, c.new_cache(len(ids))), dim=-1)[split:]
    assert_close(step, prefill, f"{arch} {outtype}: C step vs C prefill")
    if outtype in ("f32", "f16", "bf16"):  # no activation quantization: same math as torch
        ref = decode_logprobs(load(path, "torch"), ids, split)
        assert_close(step, ref, f"{arch} {outtype}: C step vs torch decode")


def test_sparse_thresholds_skip_the_same_neurons(hf_model, tmp_path):
    arch, hf_dir = hf_model
    path = convert(hf_dir, tmp_path / "m.gguf", "f32", progress=False)
    c, t = load(path, "c"), load(path, "torch")
    thresholds = [0.02] * c.config.n_layer
    c.expert_threshold = t.expert_threshold = thresholds
    ids = prompt(c.config.n_vocab)
    step = decode_logprobs(c, ids, 8)
    ref = decode_logprobs(t, ids, 8)
    assert 0.0 < c.stats.sparsity < 1.0
    assert c.stats.active == t.stats.active and c.stats.neurons == t.stats.neurons
    assert_close(step, ref, f"{arch}: sparse C step vs torch")


@pytest.mark.parametrize("arch", ["olmoe", "qwen3moe"])  # q/k norm over all heads, per head
def test_partial_rope_and_clamp(arch, tmp_path):
    """rope_dim < head_dim and clamp_kqv, which no tiny HF family sets, through both paths."""
    path = convert(make_tiny_hf_model(arch, tmp_path / "hf"), tmp_path / "m.gguf", "f32", False)
    c, t = load(path, "c"), load(path, "torch")
    cfg = dataclasses.replace(c.config, rope_dim=c.config.head_dim // 2, clamp_kqv=0.05)
    c.config = t.config = cfg
    c.use_core(c.core)  # describe the new config to the C decoder
    ids = prompt(cfg.n_vocab)
    assert_close(decode_logprobs(c, ids, 5), decode_logprobs(t, ids, 5), f"{arch} partial rope")


def test_cache_growth_and_reuse(tmp_path):
    """The step follows the cache when it reallocates (KVCache grows in chunks) and truncates."""
    hf_dir = make_tiny_hf_model("qwen2moe", tmp_path / "hf")
    path = convert(hf_dir, tmp_path / "m.gguf", "f32", progress=False)
    c, t = load(path, "c"), load(path, "torch")
    ids = prompt(c.config.n_vocab, n=20)
    cc, ct = c.new_cache(40), t.new_cache(40)
    cc._CHUNK = ct._CHUNK = 3  # reallocate every few tokens
    assert_close(decode_logprobs(c, ids, 2, cc), decode_logprobs(t, ids, 2, ct), "growth")
    cc.truncate(10)
    ct.truncate(10)
    assert_close(decode_logprobs(c, ids[10:], 1, cc), decode_logprobs(t, ids[10:], 1, ct), "reuse")


def test_step_refuses_bad_token_and_position(tmp_path):
    hf_dir = make_tiny_hf_model("mixtral", tmp_path / "hf")
    c = load(convert(hf_dir, tmp_path / "m.gguf", "q8_0", progress=False), "c")
    cache = c.new_cache(4)
    cache.reserve(1)
    with pytest.raises(cpu_core.CoreError, match="token 4096 is outside"):
        c._decoder.step(c.config.n_vocab, cache)
    cache.n_tokens = cache.capacity  # no room left in the storage
    with pytest.raises(cpu_core.CoreError, match="outside the cache"):
        c._decoder.step(0, cache)


# ---- the seams: k per step, routing out, per-layer calls, expert maps -----------------------


def converted(hf_model, tmp_path, outtype: str = "f32") -> Path:
    arch, hf_dir = hf_model
    return convert(hf_dir, tmp_path / f"{arch}-{outtype}.gguf", outtype, progress=False)


def step_logprobs(c: CpuExecutor, ids: torch.Tensor, split: int, **step) -> torch.Tensor:
    """Prefill ids[:split] (the executor's torch path, with c.config), then CpuDecoder.step per
    token with `step`'s keywords; log-probs of the decoded positions."""
    cache = c.new_cache(len(ids))
    c.forward(ids[:split], cache)
    rows = []
    for j in range(split, len(ids)):
        cache.reserve(1)
        logits, _ = c._decoder.step(int(ids[j]), cache, c.expert_threshold, **step)
        rows.append(logits)
    return torch.log_softmax(torch.cat(rows), dim=-1)


def test_step_with_k_equals_the_reference_with_that_many_experts(hf_model, tmp_path):
    """A step with k experts per token is the torch reference whose config routes k
    (dataclasses.replace(config, n_expert_used=k)); k = None is the model's own, bit for bit."""
    path = converted(hf_model, tmp_path)
    c, t = load(path, "c"), load(path, "torch")
    cfg = c.config
    ids = prompt(cfg.n_vocab, n=16)
    default = step_logprobs(c, ids, 6)
    assert torch.equal(default, step_logprobs(c, ids, 6, k=cfg.n_expert_used))
    # (llama4 routes 1: then k = 3 only)
    for k in sorted({1, min(cfg.n_expert_used + 2, cfg.n_expert)} - {cfg.n_expert_used}):
        c.config = t.config = dataclasses.replace(cfg, n_expert_used=k)  # prefill routes k too
        got = step_logprobs(c, ids, 6, k=k)
        assert_close(got, decode_logprobs(t, ids, 6), f"{hf_model[0]} k={k}: C step vs torch")
        # k mattered: the logprobs moved well past the tolerance the reference is met to
        assert (got - default).abs().max() > 10 * LOGPROB_TOL


def test_step_routing_is_the_reference_router(hf_model, tmp_path):
    """route_ids / route_logits of a step: per MoE layer the reference's top-k ids (in order) and
    the router's logits of the reference's FFN input, before the softmax; dense-FFN layers give
    -1 and NaN rows. Logits tolerance: the two hidden states agree to ~1e-6 relative (the
    log-prob tests), a router dot over n_embd adds ~n_embd u; 1e-4 is 10-100x that, while a wrong
    row, a copy after the softmax or a stale layer is O(1)."""
    path = converted(hf_model, tmp_path)
    c, t = load(path, "c"), load(path, "torch")
    cfg = c.config
    # per MoE layer the reference's FFN input (its _ffn's) and chosen ids (the observer's: one
    # call per top-k slot where the weight is on the input, llama4)
    seen: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    ffn = t._ffn

    def recording_ffn(i, blk, x, k, trace=None):
        seen[i] = (x[-1], [])
        return ffn(i, blk, x, k, trace)

    t._ffn = recording_ffn
    t.gate_observer = lambda i, store, x, ids, act: seen[i][1].append(ids[-1])
    ids = prompt(cfg.n_vocab, n=10)
    cache_c, cache_t = c.new_cache(len(ids)), t.new_cache(len(ids))
    c.forward(ids[:6], cache_c)
    t.forward(ids[:6], cache_t)
    route_ids = torch.empty(cfg.n_layer, cfg.n_expert_used, dtype=torch.int32)
    route_logits = torch.empty(cfg.n_layer, cfg.n_expert)
    for j in range(6, len(ids)):
        t.forward(ids[j : j + 1], cache_t)
        cache_c.reserve(1)
        c._decoder.step(int(ids[j]), cache_c, route_ids=route_ids, route_logits=route_logits)
        for i, blk in enumerate(c.weights.blocks):
            if blk.experts is None:
                assert (route_ids[i] == -1).all() and route_logits[i].isnan().all()
                continue
            x, slots = seen[i]
            want_ids = torch.cat(slots)
            want = x.double() @ blk.router.dequantize().double().T
            if blk.router_bias is not None:  # gpt-oss
                want = want + blk.router_bias.double()
            assert (route_logits[i].double() - want).abs().max() <= 1e-4 * (1 + want.abs().max())
            assert route_ids[i].tolist() == want_ids.tolist(), (i, j)
        assert c._decoder.n_pairs == c._decoder.n_moe_layers * cfg.n_expert_used


def test_step_in_pieces_is_the_step(hf_model, tmp_path):
    """begin, attention(i) and ffn(i) per layer (with the residual stream read and written back
    between them), end: the same logits, neurons, pairs and routing as one step, bit for bit
    (Q8_0, sparse thresholds: the quantized and sparse paths too)."""
    path = converted(hf_model, tmp_path, "q8_0")
    c = load(path, "c")
    cfg, dec = c.config, c._decoder
    thresholds = [0.02] * cfg.n_layer
    ids = prompt(cfg.n_vocab, n=10)
    caches = [c.new_cache(len(ids)), c.new_cache(len(ids))]
    for cache in caches:
        c.forward(ids[:5], cache)
    outs = [
        (torch.empty(cfg.n_layer, cfg.n_expert_used, dtype=torch.int32),
         torch.empty(cfg.n_layer, cfg.n_expert))
        for _ in caches
    ]  # fmt: skip
    for j in range(5, len(ids)):
        tok = int(ids[j])
        for cache in caches:
            cache.reserve(1)
        (r1, l1), (r2, l2) = outs
        logits1, n1 = dec.step(tok, caches[0], thresholds, route_ids=r1, route_logits=l1)
        pairs1 = dec.n_pairs
        dec.begin(tok, caches[1], thresholds, route_ids=r2, route_logits=l2)
        for i in range(cfg.n_layer):
            dec.attention(i)
            dec.write_x(dec.read_x())
            dec.ffn(i)
        logits2, n2 = dec.end()
        assert torch.equal(logits1, logits2) and (n1, pairs1) == (n2, dec.n_pairs)
        assert torch.equal(r1, r2) and torch.equal(l1.nan_to_num(), l2.nan_to_num())
        assert caches[0].n_tokens == caches[1].n_tokens == j + 1


def test_expert_maps_split_the_experts_between_two_devices(hf_model, tmp_path):
    """Offloading's flow on the C core alone: per layer the step computes the even experts
    (expert_maps), and "the other device" (here CpuCore.moe_ffn with the complementary map, from
    the step's routing outputs and the residual stream) adds the odd ones' share through
    read_x / write_x: the logits are those of the plain step (the two shares are summed in
    another order: within LOGPROB_TOL, as f32 rounding through the layers). Identity maps are
    the plain step bit for bit."""
    from pyruntime.model.reference import rms_norm

    path = converted(hf_model, tmp_path)
    c = load(path, "c")
    cfg, dec, core = c.config, c._decoder, c.core
    even = torch.where(torch.arange(cfg.n_expert) % 2 == 0, torch.arange(cfg.n_expert), -1)
    odd = torch.where(even < 0, torch.arange(cfg.n_expert), -1).int()
    ids = prompt(cfg.n_vocab, n=10)
    plain = step_logprobs(c, ids, 5)
    ident = [torch.arange(cfg.n_expert, dtype=torch.int32)] * cfg.n_layer
    assert torch.equal(plain, step_logprobs(c, ids, 5, expert_maps=ident))

    cache = c.new_cache(len(ids))
    c.forward(ids[:5], cache)
    route_ids = torch.empty(cfg.n_layer, cfg.n_expert_used, dtype=torch.int32)
    route_logits = torch.empty(cfg.n_layer, cfg.n_expert)
    rows = []
    for j in range(5, len(ids)):
        cache.reserve(1)
        dec.begin(int(ids[j]), cache, route_ids=route_ids, route_logits=route_logits,
                  expert_maps=[even] * cfg.n_layer)  # fmt: skip
        pairs_odd = 0
        for i, blk in enumerate(c.weights.blocks):
            dec.attention(i)
            x0 = dec.read_x()
            dec.ffn(i)
            if blk.experts is None:
                continue
            h = rms_norm(x0, blk.ffn_norm, cfg.rms_eps)[None]
            chosen = route_ids[i].long()
            store = blk.experts

            def odd_share(x, ids, w, store=store):
                return core.moe_ffn(
                    store.raw, int(store.qtype), store.n_expert, store.n_ff, store.n_embd, x,
                    ids[None], w[None], cfg.activation, expert_map=odd, bias=store.bias_pair,
                    swiglu=store.swiglu,
                )[0]  # fmt: skip

            if cfg.expert_input_weight:  # llama4: sigmoid(logit) times each slot's input
                w = torch.sigmoid(route_logits[i][chosen])
                y_odd = sum(odd_share(h * w[s], chosen[s : s + 1], torch.ones(1))
                            for s in range(len(chosen)))  # fmt: skip
            else:
                p = torch.softmax(route_logits[i], dim=-1)
                w = p[chosen]
                if cfg.expert_weights_norm:
                    w = w / w.sum()
                w = w * cfg.expert_weights_scale  # deepseek2's routed scaling factor
                y_odd = odd_share(h, chosen, w)
            pairs_odd += int((odd[chosen] >= 0).sum())
            dec.write_x(dec.read_x() + y_odd[0] * cfg.residual_scale)
        logits, _ = dec.end()
        assert dec.n_pairs + pairs_odd == dec.n_moe_layers * cfg.n_expert_used
        rows.append(logits)
    split = torch.log_softmax(torch.cat(rows), dim=-1)
    assert_close(split, plain, f"{hf_model[0]}: even experts here + odd ones elsewhere")


def test_a_plain_step_after_one_with_extras_is_plain(tmp_path):
    """The decoder reuses one argument struct: after a step with k, maps and routing outputs, a
    plain step routes the model's k, computes every expert and writes no routing tensor."""
    hf_dir = make_tiny_hf_model("qwen2moe", tmp_path / "hf")
    c = load(convert(hf_dir, tmp_path / "m.gguf", "f32", progress=False), "c")
    cfg, dec = c.config, c._decoder
    ids = prompt(cfg.n_vocab, n=8)
    plain = step_logprobs(c, ids, 6)
    cache = c.new_cache(len(ids))
    c.forward(ids[:6], cache)
    route_ids = torch.empty(cfg.n_layer, 1, dtype=torch.int32)
    none = torch.full((cfg.n_expert,), -1, dtype=torch.int32)
    cache.reserve(1)
    dec.step(int(ids[6]), cache, k=1, route_ids=route_ids, expert_maps=[none] * cfg.n_layer)
    assert dec.n_pairs == 0
    route_ids.fill_(-7)
    cache.n_tokens -= 1  # the same position again, plainly
    rows = []
    for j in (6, 7):
        cache.reserve(1)
        logits, _ = dec.step(int(ids[j]), cache)
        rows.append(logits)
    assert torch.equal(torch.log_softmax(torch.cat(rows), dim=-1), plain)
    assert (route_ids == -7).all() and dec.n_pairs == dec.n_moe_layers * cfg.n_expert_used


def test_step_seams_refuse_bad_arguments(tmp_path):
    hf_dir = make_tiny_hf_model("mixtral", tmp_path / "hf")
    c = load(convert(hf_dir, tmp_path / "m.gguf", "q8_0", progress=False), "c")
    cfg, dec = c.config, c._decoder
    cache = c.new_cache(4)
    cache.reserve(1)
    for k in (0, cfg.n_expert + 1):
        with pytest.raises(cpu_core.CoreError, match=f"k={k} experts per token is outside"):
            dec.step(1, cache, k=k)
    with pytest.raises(cpu_core.CoreError, match="route_ids must be a contiguous torch.int32"):
        dec.step(1, cache, route_ids=torch.empty(cfg.n_layer, cfg.n_expert_used + 1))
    with pytest.raises(cpu_core.CoreError, match="expert_maps has 1 entries"):
        dec.step(1, cache, expert_maps=[None])
    bad = torch.zeros(cfg.n_expert, dtype=torch.int32)
    bad[2] = cfg.n_expert
    with pytest.raises(cpu_core.CoreError, match=r"expert map of layer 0: \[2\] = 4 is outside"):
        dec.step(1, cache, expert_maps=[bad] + [None] * (cfg.n_layer - 1))
    with pytest.raises(cpu_core.CoreError, match="x has shape"):
        dec.write_x(torch.zeros(cfg.n_embd + 1))
    dec.begin(1, cache)
    with pytest.raises(cpu_core.CoreError, match=f"layer {cfg.n_layer} is outside"):
        dec.attention(cfg.n_layer)
    assert cache.n_tokens == 0  # nothing advanced by the refused calls


# ---- C unit tests under sanitizers ----------------------------------------------------------


def test_c_decode_tests_under_asan_ubsan(tmp_path):
    """tests/c/test_decode.c: every decode path and error path under ASan + UBSan + LSan."""
    run_sanitized_c_test(tmp_path, "test_decode", "all C decode tests passed")


def test_single_token_is_the_fast_paths_id_check():
    """The decode fast paths (C step, CUDA-graph replay) take one id without building a tensor:
    a list or tensor of one id gives it, anything longer None; an id outside the vocabulary is
    the same UsageError as token_ids gives."""
    from pyruntime.errors import UsageError
    from pyruntime.model.tokens import single_token

    assert single_token([5], 10) == 5 and single_token(torch.tensor([[7]]), 10) == 7
    assert single_token([1, 2], 10) is None and single_token(torch.tensor([1, 2]), 10) is None
    for bad in ([10], [-1], torch.tensor([12])):
        with pytest.raises(UsageError, match=r"token id out of range \[0, 10\)"):
            single_token(bad, 10)
