"""--outtype q4_k_m / q5_k_m / q6_k: llama-quantize's per-tensor mix (which tensors get more bits,
the fallback where a row is not a multiple of 256), and models of those files running on the C
core close to F32, at rows of 256 (real K-quants) and of 64 (every K-quant falls back)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from hf_fixtures import make_tiny_hf_model
from test_parity import load_runtime, mean_kl, prompt_ids, runtime_logprobs

from pyruntime.converter import convert, tensors
from pyruntime.converter.tensors import choose_qtype, quantize_rows, use_more_bits
from pyruntime.cpu.core import CoreError
from pyruntime.gguf.file import open_gguf

# Mean KL from F32 per token (nats) over the 64 tokens of test_parity's prompt, tiny random olmoe /
# qwen2moe with hidden 256: measured q4_k_m 0.0009 / 0.0014, q5_k_m 0.0003 / 0.0004, q6_k 0.0001;
# a K-quant decoder taking the top bits of sub-blocks 4..7's mins from the wrong byte gives
# 0.085 .. 0.093 (q4_k_m, q5_k_m).
KL_TOL = {"q4_k_m": 0.004, "q5_k_m": 0.0015, "q6_k": 0.0005}


DATA = Path(__file__).resolve().parent / "data" / "kquants-llama-quantize.npz"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_rows_are_llama_quantizes_bytes(qtype):
    """The converter's (and the repack's) K-quant rows: the bytes llama-quantize wrote for the
    same floats (tests/data/kquants-llama-quantize.npz)."""
    data = np.load(DATA)
    assert np.array_equal(quantize_rows(data["source"], qtype), data[qtype.name.lower()])


def test_k_quant_output_without_the_c_core_is_one_clear_error(monkeypatch):
    def missing():
        raise CoreError("C core library not found (tried /x/libpyrt.so): build it")

    monkeypatch.setattr(tensors, "_core_pool", missing)
    with pytest.raises(CoreError, match="^Q4_K output is quantized by the C core: C core library"):
        quantize_rows(np.zeros((1, 256), np.float32), Q.Q4_K)
    raw = np.load(DATA)["q6_k"][:2]  # reading needs no core: the torch decoders, same values
    want = quants.dequantize(raw, Q.Q6_K)
    assert np.array_equal(tensors.dequantize_rows(raw, Q.Q6_K, (2, 256)), want)


def test_use_more_bits_is_llamas():
    # llama.cpp's use_more_bits for 8 and 24 layers (the first and last eighth, every third)
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21,
                                                               22, 23]  # fmt: skip


def test_k_mix_rules():
    c = choose_qtype
    assert c("embd", 256, "q4_k_m", "output.weight", 8) == Q.Q6_K
    assert c("embd", 256, "q4_k_m", "token_embd.weight", 8) == Q.Q4_K
    assert c("weight", 256, "q4_k_m", "blk.0.attn_v.weight", 8) == Q.Q6_K
    assert c("weight", 256, "q4_k_m", "blk.1.attn_v.weight", 8) == Q.Q4_K
    assert c("weight", 256, "q4_k_m", "blk.1.attn_q.weight", 8) == Q.Q4_K
    assert c("experts", 256, "q4_k_m", "blk.3.ffn_gud_exps.weight", 8) == Q.Q6_K
    assert c("experts", 256, "q5_k_m", "blk.4.ffn_gud_exps.weight", 8) == Q.Q5_K
    assert c("weight", 256, "q5_k_m", "blk.7.ffn_down_shexp.weight", 8) == Q.Q6_K
    assert c("weight", 512, "q6_k", "blk.1.attn_q.weight", 8) == Q.Q6_K
    assert c("f32", 256, "q4_k_m", "blk.1.attn_norm.weight", 8) == Q.F32
    # rows not a multiple of 256: llama-quantize's fallbacks, F16 where those do not tile either
    assert c("weight", 192, "q4_k_m", "blk.1.attn_q.weight", 8) == Q.Q5_0
    assert c("weight", 192, "q4_k_m", "blk.0.attn_v.weight", 8) == Q.Q8_0
    assert c("weight", 96, "q5_k_m", "blk.1.attn_q.weight", 8) == Q.Q5_1
    assert c("weight", 48, "q4_k_m", "blk.1.attn_q.weight", 8) == Q.F16


@pytest.fixture(scope="module", params=["olmoe", "qwen2moe"])
def hf256(request, tmp_path_factory):
    arch = request.param
    sizes = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4)
    if arch == "qwen2moe":
        sizes |= dict(moe_intermediate_size=64, shared_expert_intermediate_size=256,
                      mlp_only_layers=[])  # fmt: skip
    return arch, make_tiny_hf_model(arch, tmp_path_factory.mktemp(arch), **sizes)


@pytest.mark.parametrize("outtype", ["q4_k_m", "q5_k_m", "q6_k"])
def test_kquant_models_close_to_f32(hf256, outtype, tmp_path):
    arch, hf = hf256
    ref_path = convert(hf, tmp_path / "f32.gguf", "f32", progress=False)
    path = convert(hf, tmp_path / f"{outtype}.gguf", outtype, progress=False)
    f = open_gguf(path)
    base = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K}[outtype]
    assert f.tensors["blk.0.attn_q.weight"].qtype == base
    assert f.tensors["blk.0.ffn_gud_exps.weight"].qtype == base  # layer 0 of 2: no more bits
    assert f.tensors["blk.1.ffn_gud_exps.weight"].qtype == Q.Q6_K  # the last eighth
    assert f.tensors["output.weight"].qtype == Q.Q6_K
    ids = prompt_ids(int(f.get(f"{f.arch}.vocab_size", 4096)))
    lp = runtime_logprobs(load_runtime(ref_path, "auto"), ids)
    lq = runtime_logprobs(load_runtime(path, "auto"), ids)
    lq_dec = runtime_logprobs(load_runtime(path, "auto"), ids, split=len(ids) // 2)
    kl = mean_kl(lp, lq)
    assert kl <= KL_TOL[outtype], f"{arch} {outtype}: mean KL from f32 {kl:.3g}"
    # prefill then token steps: the same model (an activation's Q8 code can flip where the two
    # paths' f32 rounding differ: single positions off by ~3e-3 in log-prob, a KL of ~1e-7)
    assert mean_kl(lq, lq_dec) <= 1e-6
    assert torch.isfinite(lq).all()


def test_llamacpp_kquant_file_runs_at_its_formats(hf256, tmp_path):
    """llama-quantize's Q4_K_M mix of a llama.cpp-layout file with rows of 256 (K-quants written
    by our quantizer, llama-quantize's stand-in here): the repacked copy keeps Q4_K where the
    layer's three expert tensors are Q4_K and takes Q6_K where down is (the more-bits layer), and
    the model stays as close to F32 as our own q4_k_m conversion."""
    from llamacpp_fixtures import llama_quantize, to_llamacpp

    from pyruntime.api import Model

    arch, hf = hf256
    if arch != "olmoe":
        pytest.skip("qwen2moe's experts have rows of 64: no K-quant there")
    ours = convert(hf, tmp_path / "f32.gguf", "f32", progress=False)
    lcpp = to_llamacpp(ours, tmp_path / "lcpp-f32.gguf")

    def k_quantize(rows, qtype):  # llama-quantize's own algorithm (the C core's, bit-exact)
        return quantize_rows(rows, qtype)

    src = llama_quantize(lcpp, tmp_path / "lcpp-Q4_K_M.gguf", "Q4_K_M", k_quantize)
    m = Model(src, device="cpu")
    got = m.file.tensors
    assert got["blk.0.ffn_gud_exps.weight"].qtype == Q.Q4_K
    assert got["blk.1.ffn_gud_exps.weight"].qtype == Q.Q6_K
    assert got["blk.0.attn_q.weight"].qtype == Q.Q4_K
    ids = prompt_ids(4096)
    lp = runtime_logprobs(load_runtime(ours, "auto"), ids)
    lq = torch.log_softmax(torch.from_numpy(m.logits(ids.tolist())).double(), -1).float()
    kl = mean_kl(lp, lq)
    assert kl <= KL_TOL["q4_k_m"], f"llama.cpp-layout Q4_K_M: mean KL from f32 {kl:.3g}"
