"""The token embedding on the GPU executor (pyruntime.gpu.weights, gpu/layers.py embed): one
device copy, shared by the lookup and a tied lm_head; Q8_0 (and Q4_0, kept as Q8_0) rows are
read by kernels.q8_embed, float GGUFs keep their one float tensor. Under the Triton interpreter
on the CPU device (tests/gpu_device.py), against the CPU path."""

from __future__ import annotations

import pytest
import torch
from gpu_device import DEVICE
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.gguf.file import open_gguf
from pyruntime.gpu.executor import GpuExecutor

N_PREFILL, N_DECODE = 9, 3
# max |d log-prob| against the CPU path for quantized dense weights: bf16 activations on the
# device vs the C core's (tests/test_qwen35.py's Q4_0 bound; measured <= 0.006 here).
LOGPROB_TOL = 0.05
ARGMAX_MARGIN = 0.05  # nats (tests/test_gpu_model.py)


@pytest.fixture(scope="module", params=[
    ("olmoe", "q8_0", True), ("olmoe", "q8_0", False), ("granitemoe", "q8_0", False),
    ("qwen2moe", "q4_0", True), ("olmoe", "f16", False),
], ids=lambda p: "-".join(str(x) for x in p))  # fmt: skip
def model(request, tmp_path_factory):
    arch, outtype, tied = request.param
    tmp = tmp_path_factory.mktemp(f"embd-{arch}-{outtype}")
    hf = make_tiny_hf_model(arch, tmp / "hf", tie_word_embeddings=tied)
    path = convert(hf, tmp / "m.gguf", outtype, progress=False)
    return outtype, tied, path


def _logprobs(net, ids: list[int]) -> torch.Tensor:
    cache = net.new_cache(len(ids))
    parts = [net.forward(ids[:N_PREFILL], cache)]
    parts += [net.forward(ids[j : j + 1], cache) for j in range(N_PREFILL, len(ids))]
    return torch.log_softmax(torch.cat(parts).double().cpu(), dim=-1)


def test_one_device_copy_and_the_lookup_reads_it(model):
    outtype, tied, path = model
    f = open_gguf(path)
    gpu = GpuExecutor.from_gguf(f, DEVICE)
    e, cfg = gpu.weights.token_embd, gpu.config
    assert (gpu.weights.output is e) == tied
    host = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch").weights.token_embd
    ids = torch.tensor([5, cfg.n_vocab - 1, 0, 5, 77, 3])
    got = gpu.layers.embed(ids.to(DEVICE)).cpu()
    want = host.rows(ids) * cfg.embedding_scale
    if outtype in ("q8_0", "q4_0"):
        assert e.w is None and e.q.dtype == torch.int8  # Q8_0 bytes only, no float copy
        assert torch.equal(got, want)  # the GGUF's rows exactly, scaled once
    else:
        assert e.q is None and e.w.dtype == gpu.dtype  # the one float tensor
        assert torch.equal(got, (host.rows(ids).to(gpu.dtype).float() * cfg.embedding_scale))


def test_logits_match_the_cpu_path(model):
    _, _, path = model
    cpu = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")
    gpu = GpuExecutor.from_gguf(open_gguf(path), DEVICE)
    ids = torch.randint(0, cpu.config.n_vocab, (N_PREFILL + N_DECODE,),
                        generator=torch.Generator().manual_seed(2)).tolist()  # fmt: skip
    err = (_logprobs(gpu, ids) - _logprobs(cpu, ids)).abs().max().item()
    assert err <= LOGPROB_TOL, f"max |d log-prob| {err:.3e}"


def test_a_trained_untied_q8_0_model_matches_the_cpu_path(shared, tmp_path):
    """The trained tiny-olmoe (untied output, real text): with the Q8_0 lookup and the untied
    Q8_0 lm_head the device picks the CPU path's top token wherever that one leads by a margin
    bf16 activations cannot overturn (tests/test_gpu_model.py's q8_0 criterion). Its log-probs
    move more than a random model's: max |d log-prob| 0.21 here, 0.25 with the former bf16
    copy of the embedding."""
    from tokenizers import Tokenizer

    hf_dir = shared / "models" / "tiny-olmoe"
    path = convert(hf_dir, tmp_path / "m.gguf", "q8_0", progress=False)
    text = (shared / "data" / "eval-jargon.txt").read_text()[:2000]
    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text).ids[:24]
    cpu = CpuExecutor.from_gguf(open_gguf(path), expert_backend="torch")
    gpu = GpuExecutor.from_gguf(open_gguf(path), DEVICE)
    assert gpu.weights.output is not gpu.weights.token_embd and gpu.weights.token_embd.w is None
    got, ref = _logprobs(gpu, ids), _logprobs(cpu, ids)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= ARGMAX_MARGIN
    assert clear.sum() >= 8, "too few positions with a clear top token to judge agreement"
    agree = (got.argmax(-1) == ref.argmax(-1))[clear].double().mean().item()
    assert agree >= 0.98, f"argmax agreement {agree:.3f} over {int(clear.sum())} clear positions"
