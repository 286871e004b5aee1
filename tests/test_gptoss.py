"""GPT-OSS's own pieces of the model (the parity tests cover the whole model on every path):
YaRN against transformers', the fixture exercising every feature (so that parity fails without
each), and the layout's one-line refusals of its keys and tensors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from calibration_check import check_calibrated_sparsity
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import open_gguf
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import attention_mask
from pyruntime.model.rope import Yarn, attention_factor, inv_frequencies
from pyruntime.tools import gguf_map as gm

PARITY_TOL = 1e-3  # tests/test_parity.py: max |d log-prob| vs transformers, f32
A = "gpt-oss"


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("head_dim, orig", [(64, 4096), (16, 8)])
def test_yarn_is_transformers_yarn(truncate, head_dim, orig):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                  beta_slow=1.0, truncate=truncate,
                  original_max_position_embeddings=orig)  # fmt: skip
    cfg = GptOssConfig(head_dim=head_dim, rope_parameters=params, max_position_embeddings=32 * orig)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    yarn = Yarn(32.0, orig, 32.0, 1.0, truncate)
    assert torch.equal(inv_frequencies(head_dim, 150000.0, yarn), want)
    assert attention_factor(yarn) == want_factor
    assert not torch.equal(inv_frequencies(head_dim, 150000.0), want)  # YaRN changes them


def test_sliding_window_mask():
    """Query at position q sees keys q - window < p <= q (transformers' sliding_window_overlay)."""
    m = attention_mask(3, 7, window=2)
    assert m.tolist() == [[p in (q - 1, q) for p in range(7)] for q in range(3, 7)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("gptoss")
    hf = make_tiny_hf_model("gptoss", tmp / "hf", tie_word_embeddings=True)
    return hf, convert(hf, tmp / "m.gguf", "f32", progress=False)


def test_the_fixture_exercises_every_feature(tiny):
    """Without any one of its features the reference is off transformers by far more than the
    parity tolerance: the parity tests fail when a path drops one."""
    from transformers import AutoModelForCausalLM

    hf, path = tiny
    ids = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        ref = torch.log_softmax(model(ids[None]).logits[0], dim=-1)

    def error(change) -> float:
        ex = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")
        change(ex)
        lp = torch.log_softmax(ex.forward(ids, ex.new_cache(len(ids))), dim=-1)
        return (lp - ref).abs().max().item()

    def config(**fields):
        return lambda ex: setattr(ex, "config", dataclasses.replace(ex.config, **fields))

    def blocks(**fields):
        return lambda ex: [setattr(b, k, v) for b in ex.weights.blocks for k, v in fields.items()]

    def experts(**fields):
        return lambda ex: [
            setattr(b.experts, k, v) for b in ex.weights.blocks for k, v in fields.items()
        ]

    assert error(lambda ex: None) <= PARITY_TOL
    ablations = {
        "sliding window": config(sliding_layers=(False, False)),
        "yarn": config(rope_yarn=None),
        "sinks": blocks(sinks=None),
        "o bias": blocks(bo=None),
        "q bias": blocks(bq=None),
        "router bias": blocks(router_bias=None),
        "expert biases": experts(bias=None),
        "swiglu clamp": experts(swiglu=(1.702, 1e9)),
        "swiglu alpha": experts(swiglu=(1.0, 7.0)),
    }
    for name, change in ablations.items():
        assert error(change) > 3 * PARITY_TOL, name


@pytest.fixture(scope="module")
def fm(tiny) -> gm.FileMap:
    return gm.map_file(tiny[1].read_bytes())


def refused(tmp_path, data: bytes, *fragments: str) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError) as info:
        ModelConfig.from_gguf(open_gguf(path))
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def with_kv(fm: gm.FileMap, key: str, vtype: int, value) -> bytes:
    blob = gm.kv_blob(key, vtype, value)
    return gm.rebuild(fm, kvs=[blob if k.key == key else fm.kv_blob(k) for k in fm.kvs])


def without_tensor(fm: gm.FileMap, name: str) -> bytes:
    blobs, data, offset = [], b"", 0
    for t in fm.tensors:
        if t.name != name:
            blobs.append(fm.tensor_blob(t, offset=offset))
            data += fm.padded(t)
            offset += t.padded_size
    return gm.build(fm, [fm.kv_blob(k) for k in fm.kvs], blobs, data)


@pytest.mark.parametrize(
    "key, vtype, value, fragments",
    [
        (f"{A}.rope.scaling.type", gm.STRING, "longrope", ["rope.scaling.type", "none, yarn"]),
        (f"{A}.rope.scaling.factor", gm.F32, -2.0, ["rope.scaling.factor", "> 0"]),
        (f"{A}.attention.sliding_window_pattern", gm.ARRAY, (gm.BOOL, [True]),
         ["sliding_window_pattern has 1 entries", "(2)"]),
        (f"{A}.attention.sliding_window", gm.U32, 0, ["attention.sliding_window' is missing or 0"]),
        ("pyruntime.swiglu_limit", gm.F32, 0.0, ["pyruntime.swiglu_limit", "> 0"]),
        ("pyruntime.swiglu_alpha", gm.U32, 2, ["pyruntime.swiglu_alpha", "FLOAT32"]),
        ("pyruntime.expert_activation", gm.STRING, "relu", ["unknown expert activation 'relu'"]),
    ],
)  # fmt: skip
def test_bad_keys_are_one_line(fm, tmp_path, key, vtype, value, fragments):
    assert any(k.key == key for k in fm.kvs), key
    refused(tmp_path, with_kv(fm, key, vtype, value), *fragments)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("blk.1.attn_sinks.weight", "tensor 'blk.1.attn_sinks.weight' is missing"),
        ("blk.0.ffn_gate_inp.bias", "tensor 'blk.0.ffn_gate_inp.bias' is missing"),
        ("blk.0.ffn_gu_exps.bias", "tensor 'blk.0.ffn_gu_exps.bias' is missing"),
        ("blk.1.attn_output.bias", "'blk.1.attn_output.bias' is missing (the file has"),
    ],
)
def test_missing_tensors_are_one_line(fm, tmp_path, name, fragment):
    refused(tmp_path, without_tensor(fm, name), fragment)


def test_mxfp4_experts_on_the_gpu_path(tiny, tmp_path):
    """The GPU executor (under the interpreter here) on MXFP4 experts reads them repacked
    (mxfp4r) and gives the CPU path's log-probs within bf16's tolerance (quantized dense
    weights: bf16 activations on the device), prefill and decode, top tokens the same."""
    from pyruntime.gpu.executor import GpuExecutor
    from pyruntime.kernels.testing import DEVICE

    f = open_gguf(convert(tiny[0], tmp_path / "mx.gguf", "mxfp4", progress=False))
    cpu = CpuExecutor.from_gguf(f, expert_backend="torch")
    gpu = GpuExecutor.from_gguf(f, DEVICE)
    assert {b.experts_fmt for b in gpu.weights.blocks if b.experts is not None} == {"mxfp4r"}
    ids = torch.randint(0, cpu.config.n_vocab, (11,), generator=torch.Generator().manual_seed(4))

    def logprobs(model):
        cache = model.new_cache(len(ids))
        parts = [model.forward(ids[:7], cache)]
        parts += [model.forward(ids[j : j + 1], cache) for j in range(7, len(ids))]
        return torch.log_softmax(torch.cat(parts).double().cpu(), dim=-1)

    want, got = logprobs(cpu), logprobs(gpu)
    assert (got - want).abs().max().item() <= 2e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_broken_mxfp4_scale_is_one_line(tiny, tmp_path):
    """A 0xFF (NaN) E8M0 scale in an MXFP4 expert tensor: loading names the tensor and the block
    (expert, neuron, row, block); nothing computes with it."""
    from gguf import GGUFReader

    path = convert(tiny[0], tmp_path / "mx.gguf", "mxfp4", progress=False)
    t = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_gud_exps.weight")
    assert t.tensor_type.name == "MXFP4"
    # expert 2, neuron 5, down row, block 1: rows of 64 elements = 2 blocks of 17 bytes
    row = (2 * 32 + 5) * 3 + 2
    data = bytearray(path.read_bytes())
    data[int(t.data_offset) + (row * 2 + 1) * 17] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as info:
        CpuExecutor.from_gguf(open_gguf(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    for fragment in (
        "'blk.1.ffn_gud_exps.weight'",
        "0xFF",
        "expert 2, neuron 5, down row, block 1",
    ):
        assert fragment in message, message


def test_calibrate_and_sparsity_hit_the_target(tiny, tmp_path):
    """`pyruntime calibrate` then --sparsity on gpt-oss: thresholds on |act(gate + bias)| of the
    clamped SwiGLU, measured on one text and applied to another, drop the target fraction of
    routed neurons within 3 points (512 tokens x 2 layers x 2 experts x 32 neurons = 65k
    decisions per target), through the C core's prefill and decode step."""
    check_calibrated_sparsity(tiny[0], tmp_path, (0.3, 0.5, 0.7, 0.9))
