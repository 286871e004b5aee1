"""Qwen3.5-MoE: the Gated DeltaNet math, its recurrent state in the cache, the converter's
multimodal layout and its one-line refusals. Logits vs transformers (prefill and token-by-token
decode, f32 / q8_0 / mxfp4, both expert backends) are in tests/test_parity.py (ARCHS).

The chunked form (prefill) and the recurrent form (decode) of the delta rule are compared at odd
shapes in float64, where both are exact up to rounding (<= 1e-10 measured ~1e-13): a wrong decay
index, a missing beta or a chunk boundary dropping the state is O(1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from calibration_check import check_calibrated_sparsity
from conversion_checks import (
    check_config_refused,
    check_missing_tensor_refused,
    check_text_model_converted,
    multimodal_checkpoint,
)
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor, c_decoder_runs
from pyruntime.decoding.session import Session
from pyruntime.errors import ModelFileError, UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.model import deltanet


def _inputs(T: int, H: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    d = dict(generator=g, dtype=torch.float64)
    q = deltanet.l2norm(torch.randn(T, H, dk, **d)) * dk**-0.5
    k = deltanet.l2norm(torch.randn(T, H, dk, **d))
    v = torch.randn(T, H, dv, **d)
    gate = -torch.rand(T, H, **d) * 2  # log decay in (-2, 0]
    beta = torch.rand(T, H, **d)
    state = torch.randn(H, dk, dv, **d)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("T", [1, 5, 16, 17, 130])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_form_is_the_recurrence(T, chunk):
    q, k, v, g, beta, state = _inputs(T, 3, 5, 7, seed=T * 100 + chunk)
    o_rec, s_rec = deltanet.recurrent(q, k, v, g, beta, state)
    o_chk, s_chk = deltanet.chunked(q, k, v, g, beta, state, chunk=chunk)
    assert (o_rec - o_chk).abs().max() <= 1e-10
    assert (s_rec - s_chk).abs().max() <= 1e-10


def test_recurrence_is_the_delta_rule():
    """One step by hand: S' = e^g S + k (beta (v - e^g S^T k))^T, o = S'^T q."""
    q, k, v, g, beta, state = _inputs(1, 2, 4, 3, seed=7)
    o, s = deltanet.recurrent(q, k, v, g, beta, state)
    for h in range(2):
        decayed = state[h] * g[0, h].exp()
        u = beta[0, h] * (v[0, h] - decayed.T @ k[0, h])
        want = decayed + torch.outer(k[0, h], u)
        assert torch.allclose(s[h], want) and torch.allclose(o[0, h], want.T @ q[0, h])


def test_causal_conv_is_conv1d_and_carries_its_state():
    C, K, T = 6, 4, 11
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(T, C, generator=g), torch.randn(C, K, generator=g)
    want = F.silu(F.conv1d(x.T[None], w[:, None], padding=K - 1, groups=C)[0, :, :T].T)
    y, _ = deltanet.causal_conv(x, torch.zeros(C, K - 1), w)
    assert torch.allclose(y, want, atol=1e-6)
    y1, state = deltanet.causal_conv(x[:7], torch.zeros(C, K - 1), w)  # then token by token
    parts = [y1]
    for t in range(7, T):
        yt, state = deltanet.causal_conv(x[t : t + 1], state, w)
        parts.append(yt)
    assert torch.allclose(torch.cat(parts), want, atol=1e-6)


# ---- the model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model("qwen35moe", tmp_path_factory.mktemp("q35") / "hf")


@pytest.fixture(scope="module")
def f32_path(hf_dir, tmp_path_factory) -> Path:
    return convert(hf_dir, tmp_path_factory.mktemp("q35g") / "m.gguf", "f32", progress=False)


def test_cpu_path_runs_the_deltanet_layers_in_torch_and_the_experts_in_c(f32_path):
    model = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="c")
    assert not c_decoder_runs(model.config) and model._decoder is None
    assert model.core is not None and model.linear == model._core_linear
    assert model.config.recurrent_layers == (True, True, True, False)


def test_session_reuses_a_prompt_snapshot_and_restarts_without_one(f32_path):
    model = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="torch")
    ids = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    fresh = Session(model, 64).prefill(ids)[0]

    s = Session(model, 64)
    s.prefill(ids[:20])  # a prompt: its state is kept at position 20
    for t in ids[20:24]:
        s.feed(t)
    logits, evaluated = s.prefill(ids)  # the cache's 24 tokens are a prefix: it goes on
    assert evaluated == 6 and torch.allclose(logits, fresh, atol=1e-5)

    s = Session(model, 64)
    s.prefill(ids[:20] + [7, 8])  # diverges after 20: its snapshot at 22, the one at 20 absent
    logits, evaluated = s.prefill(ids)
    assert evaluated == 30 and torch.allclose(logits, fresh, atol=1e-5)

    s = Session(model, 64)
    s.prefill(ids[:20])
    s.prefill(ids[:20] + [7])  # snapshot at 20 kept (prefill of one more token)
    s.prefill(ids[:20] + [5, 6])  # back to 20, then 2 new tokens
    logits, evaluated = s.prefill(ids)
    assert evaluated == 10 and torch.allclose(logits, fresh, atol=1e-5)

    s.feed(ids[0])
    s.rewind(1)  # back to the prompt's end: its snapshot
    assert s.cache.n_tokens == len(s.ids) == 30
    s.feed(ids[0])
    s.feed(ids[1])
    with pytest.raises(UsageError, match="recurrent .DeltaNet. state"):
        s.rewind(1)  # position 31: no snapshot, the session starts over
    assert s.cache.n_tokens == len(s.ids) == 0


def test_gpu_whole_model_or_the_hybrid(f32_path, monkeypatch):
    """The GPU executor runs the model (tests/test_gpu_model.py); a budget that only fits the
    hybrid takes it (tests/test_offload_qwen35.py), under auto and --device cuda alike."""
    from pyruntime.model.config import ModelConfig
    from pyruntime.offload.plan import device_bytes
    from pyruntime.placement import choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tiny GPU")
    f = open_gguf(f32_path)
    cfg = ModelConfig.from_gguf(f)
    need = device_bytes(f, cfg, 64)
    assert choose_device("auto", f, cfg, 64).plan is None  # the whole model on the GPU
    small = need.fixed + 4 * need.expert_bytes
    for device in ("auto", "cuda"):
        choice = choose_device(device, f, cfg, 64, gpu_mem=small)
        assert choice.hybrid and choice.device == "cuda" and choice.note is None
        assert choice.plan.slots == 4


def test_gpu_q4_0_matrices_run_as_q8_0(hf_dir, tmp_path):
    """A Q4_0 GGUF on the GPU executor: its dense matrices (DeltaNet projections, attention,
    shared experts, lm_head) are the Q8_0 kernels' q, d holding the GGUF's weights exactly (half
    a bf16 copy's bytes); the device-memory plan counts them as a Q8_0 file's; a prompt (the
    chunked DeltaNet kernels) then decode steps give the CPU path's log-probabilities (bf16
    activations vs the C core's Q8 ones: measured <= 0.032, tolerance 0.05)."""
    pytest.importorskip("triton")
    from gpu_device import DEVICE

    from pyruntime.gguf.quant import dequantize
    from pyruntime.gpu.executor import GpuExecutor
    from pyruntime.kernels.q8_linear import dequantize_q8
    from pyruntime.model.config import ModelConfig
    from pyruntime.offload.plan import device_bytes

    path = convert(hf_dir, tmp_path / "m.gguf", "q4_0", progress=False)
    f = open_gguf(path)
    t = f.tensor("blk.0.attn_qkv.weight")
    assert t.qtype.name == "Q4_0"
    gpu = GpuExecutor.from_gguf(f, DEVICE)
    d = gpu.blocks[0].deltanet
    assert d.in_proj.w is None and d.out.w is None and gpu.weights.output.w is None
    C = gpu.config.ssm_conv_channels
    want = dequantize(t.data, t.qtype, tuple(t.shape))
    assert torch.equal(dequantize_q8(d.in_proj.q[:C], d.in_proj.d[:C], torch.float32).cpu(), want)
    q8 = open_gguf(convert(hf_dir, tmp_path / "q8.gguf", "q8_0", progress=False))
    cfg = ModelConfig.from_gguf(f)
    assert device_bytes(f, cfg, 64).dense == device_bytes(q8, cfg, 64).dense
    cpu = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")
    caches = [m.new_cache(32) for m in (gpu, cpu)]
    ids = [1, 5, 9, 2, 7, 3, 11]
    for tokens in (ids, [4], [6], [8]):
        got, ref = (m.forward(tokens, c) for m, c in zip((gpu, cpu), caches, strict=True))
        lp, lp_ref = (torch.log_softmax(x[-1].float().cpu(), -1) for x in (got, ref))
        assert (lp - lp_ref).abs().max() <= 0.05


def test_info_shows_the_deltanet_fields(f32_path, capsys):
    from pyruntime.cli import main

    assert main(["info", str(f32_path)]) == 0
    out = capsys.readouterr().out
    assert "Gated DeltaNet on 3 of 4 layers (full attention: 3)" in out
    assert "2 key x 16, 4 value x 24; conv kernel 4" in out
    assert "8 of 32 per head" in out


def test_bench_runs_on_the_cpu_and_labels_the_file(f32_path, capsys):
    """`pyruntime bench`'s table labels the model by the type holding most weights (a Gated
    DeltaNet layer has no attn_q, which it once read: the run ended in an error)."""
    from pyruntime.cli import main

    assert main(["bench", str(f32_path), "--device", "cpu", "-p", "4", "-n", "2", "-r", "1"]) == 0
    out = capsys.readouterr().out
    assert "| qwen35moe " in out and " F32 |" in out and "| tg2 |" in out


def test_a_file_missing_a_deltanet_tensor_is_refused(f32_path, tmp_path):
    from gguf import GGUFReader, GGUFWriter

    r = GGUFReader(f32_path)
    path = tmp_path / "broken.gguf"
    w = GGUFWriter(path, "qwen35moe")
    for field in r.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype.name == "ARRAY":
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in r.tensors:
        if t.name != "blk.1.ssm_a":
            w.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="tensor 'blk.1.ssm_a' is missing"):
        CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")


# ---- the converter --------------------------------------------------------------------------


def _multimodal(hf_dir: Path, out: Path) -> Path:
    """The same text model as Qwen3_5MoeForConditionalGeneration stores it: tensors under
    model.language_model., a vision tower and an MTP head beside it, the config nested."""
    from safetensors.torch import load_file

    state = load_file(str(hf_dir / "model.safetensors"))
    tensors = {
        (f"model.language_model.{k[6:]}" if k.startswith("model.") else k): v
        for k, v in state.items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    return multimodal_checkpoint(hf_dir, out, tensors, config)


def test_multimodal_checkpoint_converts_its_text_model(hf_dir, f32_path, tmp_path):
    check_text_model_converted(_multimodal(hf_dir, tmp_path / "mm"), f32_path, tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "'layer_types'"),
        (dict(linear_num_value_heads=3), "'linear_num_value_heads' must be a multiple of"),
        (dict(hidden_act="gelu"), "'hidden_act' must be silu"),
        (dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.01)), "must be even"),
        (dict(rope_parameters=dict(rope_theta=1e4, rope_type="yarn", factor=2.0)), "yarn"),
    ],
)
def test_unsupported_config_values_are_one_line(hf_dir, tmp_path, config, message):
    check_config_refused(hf_dir, tmp_path, config, message)


def test_a_missing_tensor_is_one_line_and_no_file(hf_dir, tmp_path):
    check_missing_tensor_refused(hf_dir, tmp_path, "model.layers.1.linear_attn.A_log")


def test_calibrate_and_sparsity_hit_the_target(hf_dir, tmp_path):
    """`pyruntime calibrate` then --sparsity: thresholds measured on one text, applied to another,
    drop the target fraction of routed neurons within 3 points (512 tokens x 4 layers x 2
    experts x 32 neurons = 131k decisions per target), in a prompt and token by token."""
    check_calibrated_sparsity(hf_dir, tmp_path, (0.3, 0.7), every_layer_sparse=False)


def test_gpu_decode_graph_advances_the_state_once(f32_path, monkeypatch):
    """The GPU executor's decode kernel (kernels.deltanet) in a captured step: the capture's
    warm-up run must not advance the recurrent state (stood in on the CPU by eager_graph, whose
    replay reruns the step as a graph would); the replayed logits equal eager decoding's and
    the CPU path's."""
    pytest.importorskip("triton")
    from eager_graph import use_eager_graphs
    from gpu_device import DEVICE, assert_same_run

    from pyruntime.gpu.executor import GpuExecutor

    eager = GpuExecutor.from_gguf(open_gguf(f32_path), DEVICE)
    eager.cuda_graphs = False  # on CUDA both default to graphs; only the second's captures count
    graphs = GpuExecutor.from_gguf(open_gguf(f32_path), DEVICE)
    captures = use_eager_graphs(monkeypatch, graphs)
    cpu = CpuExecutor.from_gguf(open_gguf(f32_path), expert_backend="torch")
    caches = [m.new_cache(16) for m in (eager, graphs, cpu)]
    for m, c in zip((eager, graphs, cpu), caches, strict=True):
        m.forward([1, 2, 3], c)
    models = (eager, graphs, cpu)
    for tok in (4, 5, 6):
        want, got, host = (m.forward([tok], c) for m, c in zip(models, caches, strict=True))
        assert_same_run(got, want)
        assert (torch.log_softmax(got, -1) - torch.log_softmax(host, -1)).abs().max() <= 1e-4
    assert len(captures) == 1
