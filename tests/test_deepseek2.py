"""DeepSeek-V2: multi-head latent attention's two forms, its compressed cache, the group-limited
routing, the full form (query LoRA, groups) against transformers, the converter's one-line
refusals. Logits of the Lite form vs transformers (prefill and token-by-token decode, f32 / q8_0
/ mxfp4, both expert backends) are in tests/test_parity.py (ARCHS).

The absorbed form (decode) and the plain form (prompt) of the attention are compared in float64
at odd shapes, where they are one computation in another order (<= 1e-10; measured ~1e-15): a
head's k_b or v_b block taken from the wrong rows, or a missing rope key, is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from calibration_check import check_calibrated_sparsity
from conversion_checks import check_config_refused, check_missing_tensor_refused
from hf_fixtures import DEEPSEEK2_FULL, make_tiny_hf_model
from test_parity import LOGPROB_TOL, hf_logprobs, prompt_ids, runtime_logprobs

from pyruntime.converter import convert
from pyruntime.cpu.core import CoreError
from pyruntime.cpu.executor import CpuExecutor, c_decoder_runs
from pyruntime.errors import DeviceMemoryError
from pyruntime.gguf.file import open_gguf
from pyruntime.gguf.quant import QuantMatrix
from pyruntime.model import mla
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import attention_mask, route

# ---- the math -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Matrix64(QuantMatrix):
    """A float64 matrix standing in for a stored one (dequantize keeps float64)."""

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(self.raw)


def _f64_matrix(name: str, t: torch.Tensor) -> QuantMatrix:
    from gguf import GGMLQuantizationType

    return _Matrix64(name, GGMLQuantizationType.F32, tuple(t.shape), t.numpy())


def _linear64(x: torch.Tensor, w: QuantMatrix, bias=None) -> torch.Tensor:
    return x @ torch.from_numpy(w.raw).T


@pytest.mark.parametrize("H, rank, nope, rope, v, n, start", [
    (3, 7, 5, 4, 6, 1, 0), (3, 7, 5, 4, 6, 1, 9), (2, 9, 3, 6, 5, 4, 5), (5, 4, 6, 2, 3, 7, 0),
])  # fmt: skip
def test_absorbed_attention_is_the_plain_one(H, rank, nope, rope, v, n, start):
    g = torch.Generator().manual_seed(H * 1000 + n * 10 + start)
    d = dict(generator=g, dtype=torch.float64)
    end = start + n
    cfg = replace(
        _tiny_config(), n_head=H, mla_kv_rank=rank, mla_nope_dim=nope, rope_dim=rope, mla_v_dim=v
    )
    k_b, v_b = torch.randn(H * rank, nope, **d), torch.randn(H * v, rank, **d)
    w = mla.MLAWeights(None, None, None, None, None, None, _f64_matrix("k_b", k_b),
                       _f64_matrix("v_b", v_b))  # fmt: skip
    q_nope, q_pe = torch.randn(H, n, nope, **d), torch.randn(H, n, rope, **d)
    latents = torch.randn(end, rank + rope, **d)
    mask = attention_mask(start, end)
    plain = mla.attention_plain(cfg, w, q_nope, q_pe, latents, mask, 0.3)
    heads = mla.heads_linear(_linear64)
    absorbed = mla.attention_absorbed(cfg, w, q_nope, q_pe, latents, mask, 0.3, heads)
    assert plain.shape == (n, H * v)
    assert (plain - absorbed).abs().max() <= 1e-10
    # by hand, the last query of head H-1: keys [k_b^T c; k_pe], values v_b c
    h, c, k_pe = H - 1, latents[:, :rank], latents[:, rank:]
    keys = torch.cat([c @ k_b[h * rank : (h + 1) * rank], k_pe], dim=-1)
    values = c @ v_b[h * v : (h + 1) * v].T
    probs = torch.softmax(keys @ torch.cat([q_nope[h, -1], q_pe[h, -1]]) * 0.3, dim=0)
    assert torch.allclose(plain[-1, h * v :], probs @ values, atol=1e-12)


def test_group_limited_routing_picks_within_the_best_groups():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 12, generator=g) * 2
    ids, w = route(logits, 3, False, 2.5, (4, 2))
    probs = torch.softmax(logits, dim=-1)
    best_groups = probs.view(64, 4, 3).amax(-1).topk(2, dim=-1).indices
    for t in range(64):
        allowed = torch.cat([torch.arange(3) + 3 * int(b) for b in best_groups[t]])
        want = allowed[probs[t, allowed].topk(3).indices]
        assert set(ids[t].tolist()) == set(want.tolist())
        assert torch.allclose(w[t], probs[t, ids[t]] * 2.5)
    plain_ids, _ = route(logits, 3, False)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, plain_ids, strict=True))


def _tiny_config() -> ModelConfig:
    return ModelConfig(
        arch="deepseek2", n_vocab=16, n_embd=8, n_layer=1, n_head=2, n_head_kv=1, head_dim=8,
        n_expert=4, n_expert_used=2, n_ff_exp=8, context_length=64, rms_eps=1e-6,
        rope_theta=1e4, rope_dim=4, expert_weights_norm=False, mla_kv_rank=4, mla_nope_dim=4,
        mla_v_dim=4,
    )  # fmt: skip


# ---- the model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model("deepseek2", tmp_path_factory.mktemp("ds2") / "hf")


@pytest.fixture(scope="module")
def f32_path(hf_dir, tmp_path_factory) -> Path:
    return convert(hf_dir, tmp_path_factory.mktemp("ds2g") / "m.gguf", "f32", progress=False)


def test_cache_keeps_one_latent_and_rope_key_per_position(f32_path):
    model = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="c")
    cfg = model.config
    assert c_decoder_runs(cfg) and model._decoder is not None
    assert model.core is not None and model.linear == model._core_linear
    assert (cfg.mla_kv_rank, cfg.mla_nope_dim, cfg.rope_dim, cfg.mla_v_dim) == (32, 32, 16, 32)
    cache = model.new_cache(16)
    model.forward([1, 2, 3], cache)
    assert [tuple(t.shape) for t in cache.kv] == [(1, 1, 16, 48)] * 3
    assert cache.k[0].data_ptr() == cache.v[0].data_ptr()
    assert cache.k[0][0, 3:].abs().sum() == 0 and cache.k[0][0, :3].abs().min() > 0


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_full_form_matches_transformers(tmp_path, backend):
    """deepseek-v2's own form: a query LoRA, group-limited routing (the top-2 within the best of
    2 groups of 4 experts), routed_scaling_factor; f32 prefill and prefill + decode <= 1e-3."""
    hf = make_tiny_hf_model("deepseek2", tmp_path / "hf", **DEEPSEEK2_FULL)
    path = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    model = CpuExecutor.from_gguf(open_gguf(path), expert_backend=backend)
    cfg = model.config
    assert (cfg.mla_q_rank, cfg.expert_groups, cfg.expert_groups_used) == (64, 2, 1)
    assert model.blocks[0].mla.q is None and model.blocks[0].mla.q_b is not None
    ids = prompt_ids(cfg.n_vocab)
    ref = hf_logprobs(hf, ids)
    assert (runtime_logprobs(model, ids) - ref).abs().max() <= LOGPROB_TOL
    assert (runtime_logprobs(model, ids, split=len(ids) // 2) - ref).abs().max() <= LOGPROB_TOL


def test_a_budget_below_the_model_runs_hybrid(f32_path, monkeypatch, capsys):
    """The GPU executor runs the model when it fits (tests/test_gpu_model.py); a smaller budget
    plans the hybrid (tests/test_offload_deepseek2.py runs it) with the cache sized as one plane
    of latents and rope keys per layer; a budget below the dense part is one line."""
    from pyruntime import cli
    from pyruntime.offload.plan import device_bytes, gib
    from pyruntime.placement import choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tiny GPU")
    f = open_gguf(f32_path)
    cfg = ModelConfig.from_gguf(f)
    need = device_bytes(f, cfg, 64)
    assert need.kv == 3 * 64 * 48 * 4  # one plane of latents and rope keys per layer (f32)
    assert choose_device("auto", f, cfg, 64).plan is None  # the whole model on the GPU
    small = need.fixed + 4 * need.expert_bytes
    for device in ("auto", "cuda"):
        choice = choose_device(device, f, cfg, 64, gpu_mem=small)
        assert choice.hybrid and choice.plan.slots == 4 and choice.note is None
    choice = choose_device("auto", f, cfg, 64, gpu_mem=need.fixed - 1)
    assert choice.device == "cpu" and "the dense weights" in choice.note
    with pytest.raises(DeviceMemoryError, match="^--device cuda: the dense weights") as info:
        choose_device("cuda", f, cfg, 64, gpu_mem=need.fixed - 1)
    assert "\n" not in str(info.value)
    assert cli.main(["info", str(f32_path), "--gpu-mem", str(small), "-c", "64"]) == 0
    out = capsys.readouterr().out
    kv_row = next(line for line in out.splitlines() if line.startswith("KV cache (64 tokens)"))
    assert kv_row.endswith(f": {gib(need.kv)} (GPU; a latent of 32 and a rope key of 16 values per "
                           "token and layer)")  # fmt: skip
    assert "hybrid: dense weights" in out and "expert slots         : 4 (" in out


def test_gpu_decode_graph_and_group_routing_match_the_cpu_path(tmp_path, monkeypatch):
    """The full form (query LoRA, group-limited routing) on the GPU executor: prefill then
    decode steps captured in a graph (stood in on the CPU by eager_graph) equal eager decoding,
    and the CPU path's log-probs within 1e-4 (f32)."""
    pytest.importorskip("triton")
    from eager_graph import use_eager_graphs
    from gpu_device import DEVICE, assert_same_run

    from pyruntime.gpu.executor import GpuExecutor

    hf = make_tiny_hf_model("deepseek2", tmp_path / "hf", **DEEPSEEK2_FULL)
    path = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    eager = GpuExecutor.from_gguf(open_gguf(path), DEVICE)
    eager.cuda_graphs = False  # on CUDA both default to graphs; only the second's captures count
    graphs = GpuExecutor.from_gguf(open_gguf(path), DEVICE)
    captures = use_eager_graphs(monkeypatch, graphs)
    cpu = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")
    models = (eager, graphs, cpu)
    caches = [m.new_cache(16) for m in models]
    for m, c in zip(models, caches, strict=True):
        m.forward([1, 2, 3, 4, 5], c)
    for tok in (6, 7, 8):
        want, got, host = (m.forward([tok], c) for m, c in zip(models, caches, strict=True))
        assert_same_run(got, want)
        assert (torch.log_softmax(got, -1) - torch.log_softmax(host, -1)).abs().max() <= 1e-4
    assert len(captures) == 1


def test_info_shows_the_mla_fields(f32_path, capsys):
    from pyruntime.cli import main

    assert main(["info", str(f32_path)]) == 0
    out = capsys.readouterr().out
    assert "latent 32 + rope key 16 per token; per head 32 + 16 key, 32 value dims" in out
    assert "top-2 of 8, weights x1.5" in out
    assert "2 shared (ffn 64); layers 0..0 dense" in out


# ---- the converter --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(topk_method="noaux_tc"), "'topk_method' 'noaux_tc' is not supported"),
        (dict(scoring_func="sigmoid"), "'scoring_func' 'sigmoid' is not supported"),
        (dict(moe_layer_freq=2), "'moe_layer_freq' must be 1"),
        (dict(topk_method="group_limited_greedy", n_group=3, topk_group=2), "must divide"),
        (dict(topk_method="group_limited_greedy", n_group=8, topk_group=1), "fewer experts"),
        (dict(qk_rope_head_dim=15), "'qk_rope_head_dim' must be even"),
        (dict(hidden_act="gelu"), "'hidden_act' must be silu"),
    ],
)
def test_unsupported_config_values_are_one_line(hf_dir, tmp_path, config, message):
    check_config_refused(hf_dir, tmp_path, config, message)


def test_a_missing_tensor_is_one_line_and_no_file(hf_dir, tmp_path):
    check_missing_tensor_refused(hf_dir, tmp_path, "model.layers.2.self_attn.kv_b_proj.weight")


def test_calibrate_and_sparsity_hit_the_target(hf_dir, tmp_path):
    """`pyruntime calibrate` then --sparsity: thresholds measured on one text, applied to another,
    drop the target fraction of routed neurons within 3 points (512 tokens x 2 MoE layers x 2
    experts x 32 neurons = 65k decisions per target), in a prompt and token by token."""
    check_calibrated_sparsity(hf_dir, tmp_path, (0.3, 0.7))


# ---- the C core's per-head matvec -----------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("H, rows, n_in", [(1, 3, 32), (3, 37, 64), (16, 96, 128)])
def test_linear_heads_is_one_linear_per_head(qtype, H, rows, n_in):
    """pyrt_linear_heads (one pool task for all heads) gives, bit for bit, what pyrt_linear
    gives head by head on the same rows (chunks of 32 rows: 37 and 96 rows split unevenly)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pyruntime.cpu.core import CpuCore

    q = GGMLQuantizationType[qtype]
    g = torch.Generator().manual_seed(H * rows)
    w = torch.randn(H * rows, n_in, generator=g).numpy()
    raw = w.astype("float16") if qtype == "F16" else w if qtype == "F32" else quantize(w, q)
    x = torch.randn(H, n_in, generator=g)
    core = CpuCore(threads=2)
    y = core.linear_heads(raw, int(q), H * rows, n_in, x)
    want = torch.stack([
        core.linear(raw[h * rows : (h + 1) * rows], int(q), rows, n_in, x[h : h + 1])[0]
        for h in range(H)
    ])  # fmt: skip
    assert torch.equal(y, want)
    with pytest.raises(CoreError, match="shape mismatch"):
        core.linear_heads(raw, int(q), H * rows, n_in, x[:, :-1])


def test_linear_heads_checks_its_lengths():
    """The C entry refuses a head count that does not divide the rows and short x / y buffers,
    each in one pyrt_last_error line."""
    from gguf import GGMLQuantizationType

    from pyruntime.cpu import core as core_mod

    lib, ffi = core_mod._lib(), core_mod._ffi
    c = core_mod.CpuCore(threads=1)
    w = torch.zeros(6, 32).numpy()
    m = ffi.new(
        "pyrt_matrix *", (ffi.from_buffer(w), w.nbytes, int(GGMLQuantizationType.F32), 6, 32)
    )
    x, y = torch.zeros(3 * 32), torch.zeros(6)
    px, py = ffi.cast("const float *", x.data_ptr()), ffi.cast("float *", y.data_ptr())
    for heads, x_len, y_len, message in [
        (4, 96, 6, "n_heads 4 does not divide w's 6 rows"),
        (3, 95, 6, "x holds 95 floats, 3 heads of 32 need 96"),
        (3, 96, 5, "y holds 5 floats, w's 6 rows need as many"),
    ]:
        assert lib.pyrt_linear_heads(c._pool, m, heads, px, x_len, py, y_len) != 0
        assert ffi.string(lib.pyrt_last_error()).decode().endswith(message)
    assert lib.pyrt_linear_heads(c._pool, m, 3, px, 96, py, 6) == 0


# ---- the C decode step ----------------------------------------------------------------------


def test_c_mla_tests_under_asan_ubsan(tmp_path):
    """tests/c/test_mla.c: the C step's latent attention vs float64 (query LoRA on and off), its
    cache row, group-limited routing, prefill == steps bit for bit, bad shapes refused; under
    ASan + UBSan + LSan."""
    from sanitized_c import run_sanitized_c_test

    run_sanitized_c_test(tmp_path, "test_mla", "all C MLA tests passed")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_one_c_call_per_token_and_prompt(f32_path, hf_dir, tmp_path, outtype):
    """A deepseek2 decode step is one C call (pyrt_decoder_step, no reference forward) and a
    prompt one pyrt_decoder_prefill; both give the logits of the reference forward on the same C
    core, token by token (its matrices, experts and per-head k_b / v_b; MLA's softmax in torch),
    and the latent cache it wrote. For q8_0 both quantize each matrix's input to Q8 blocks: an
    f32 rounding apart (1e-6) can cross a rounding step of one block (~2e-3 on the log-probs, a
    few rows in 40), so every row is held to 5e-3 and the median row to 1e-5."""
    path = f32_path if outtype == "f32" else convert(
        hf_dir, tmp_path / "q.gguf", outtype, progress=False)  # fmt: skip
    c = CpuExecutor.from_gguf(open_gguf(path), expert_backend="c")
    ref = CpuExecutor.from_gguf(open_gguf(path), expert_backend="c")
    assert c._decoder is not None

    def no_torch_forward(*args, **kwargs):
        raise AssertionError("the reference forward ran")

    c._forward_torch = no_torch_forward
    ids = prompt_ids(c.config.n_vocab)
    cc, cr = c.new_cache(len(ids)), ref.new_cache(len(ids))
    got = [c.forward(ids[:5], cc)] + [c.forward(ids[j : j + 1], cc) for j in range(5, len(ids))]
    want = [ref._forward_torch(ids[j : j + 1], cr, False) for j in range(len(ids))]
    want = [torch.cat(want[:5])] + want[5:]
    got, want = torch.cat(got), torch.cat(want)
    err = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().amax(-1)
    assert err.max() <= (1e-5 if outtype == "f32" else 5e-3), (outtype, err.max())
    assert err.median() <= 1e-5, (outtype, err.median())
    for k, k_ref in zip(cc.k, cr.k, strict=True):
        assert (k[0, : len(ids)] - k_ref[0, : len(ids)]).abs().max() <= 1e-5


def test_session_rewind_on_the_latent_cache(f32_path):
    """Session.rewind over the C step's latent cache (big/little, draft-and-verify): after
    rewind(3) the next tokens see exactly the cache of a sequence that never had them."""
    from pyruntime.decoding.session import Session

    net = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="c")
    assert net._decoder is not None
    ids = prompt_ids(net.config.n_vocab)[:12].tolist()
    s = Session(net, 32)
    s.prefill(ids[:6])
    for t in [7, 8, 9]:
        s.feed(t)
    s.rewind(3)
    after_rewind = torch.stack([s.feed(t) for t in ids[6:]])
    fresh = Session(net, 32)
    fresh.prefill(ids[:6])
    assert torch.equal(after_rewind, torch.stack([fresh.feed(t) for t in ids[6:]]))
