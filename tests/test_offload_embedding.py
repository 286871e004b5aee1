"""An untied token embedding in host memory in the hybrid (pyruntime.offload.embedding): the
rows the host writes are, bit for bit, those the GPU's lookup makes of a device copy
(gpu/layers.py embed: kernels.q8_embed for Q8_0 and Q4_0, the activation dtype's float rows
otherwise), for every GGUF type, activation dtype and embedding scale; and the hybrid of an
untied model gives the whole model's logits (tests/test_offload.py's bounds) with no device copy
of token_embd, while a tied one keeps it on the GPU as the lm_head."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gpu_device import DEVICE
from test_offload import (
    N_DECODE,
    N_PROMPT,
    SAME_KERNELS_TOL,
    hybrid,
    ids_of,
    logprobs,
    max_err,
    n_routed,
    tiny,
)

from pyruntime.gguf.quant import FORMAT_NAMES, QuantMatrix
from pyruntime.gpu import weights
from pyruntime.gpu.executor import GpuExecutor
from pyruntime.gpu.layers import DecoderLayers
from pyruntime.kernels.expert_formats import quantize_rows
from pyruntime.offload import embedding
from pyruntime.offload.embedding import HostEmbedding

FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "mxfp4", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


def matrix(fmt: str, n_vocab: int = 37, n_embd: int = 256) -> QuantMatrix:
    g = torch.Generator().manual_seed(5)
    raw = quantize_rows(torch.randn(n_vocab, n_embd, generator=g), fmt)
    qtype = next(q for q, name in FORMAT_NAMES.items() if name == fmt)
    return QuantMatrix("token_embd.weight", qtype, (n_vocab, n_embd), raw.view(torch.uint8).numpy())


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_hosts_rows_are_the_gpu_lookups(fmt, dtype, scale, monkeypatch):
    m = matrix(fmt)
    device = torch.device(DEVICE)
    lookup = SimpleNamespace(weights=SimpleNamespace(token_embd=weights.upload_linear(m, device,
                                                                                      dtype)),
                             config=SimpleNamespace(embedding_scale=scale))  # fmt: skip
    ids = torch.tensor([5, m.shape[0] - 1, 0, 5, 17, 3, 30])
    want = DecoderLayers.embed(lookup, ids.to(device)).cpu()
    e = HostEmbedding(m, scale, dtype)
    monkeypatch.setattr(embedding, "CHUNK_ELEMENTS", 3 * m.shape[1])  # 3 chunks: 3, 3, 1 rows
    assert torch.equal(e.upload(ids, device).cpu(), want)  # a prefill's, converted on the device
    one = np.empty((1, m.shape[1]), dtype=np.float32)  # a decode step's, written by the host
    for j, token in enumerate(ids.tolist()):
        e.row(token, one)
        assert torch.equal(torch.from_numpy(one), want[j : j + 1])
    assert e.nbytes == m.raw.nbytes


def embedding_on_the_device(net):
    """The hybrid as it was before the embedding moved to host memory: token_embd uploaded, the
    lookup on the device (DecoderLayers.embed)."""
    net.weights.token_embd = weights.upload_linear(net.host.token_embd, net.device, net.dtype)
    net.embedding = None
    return net


@pytest.mark.parametrize(
    "arch, fmt",
    [("olmoe", "q8_0"), ("olmoe", "q4_0"), ("olmoe", "f16"), ("granitemoe", "f32")],
)
def test_an_untied_embedding_stays_in_host_memory(tmp_path_factory, core, arch, fmt):
    """No device copy of an untied token_embd (the lm_head is its own), and the logits of the
    hybrid with its embedding on the device, at every budget and placement (the decode step
    as graph segments, or as one graph with misses='direct'): bit for bit under the
    interpreter; with every expert in a slot, the resident model's. granitemoe: an
    embedding scale of 12."""
    model = tiny(tmp_path_factory, arch, fmt, tie_word_embeddings=False)
    _, cfg, host = model
    torch.set_num_threads(1)
    ids = ids_of(cfg, N_PROMPT + N_DECODE)
    every = n_routed(cfg, host)
    for slots, misses in ((0, "cpu"), (3, "auto"), (3, "direct"), (every, "stage")):
        net = hybrid(model, core, slots, misses)
        assert net.weights.token_embd is None and net.embedding is not None
        got = logprobs(net, ids)
        before = logprobs(embedding_on_the_device(hybrid(model, core, slots, misses)), ids)
        assert max_err(got, before) <= SAME_KERNELS_TOL, (slots, misses)
    assert max_err(got, logprobs(GpuExecutor(cfg, host, DEVICE), ids)) <= SAME_KERNELS_TOL


def test_a_tied_embedding_stays_on_the_gpu(tmp_path_factory, core):
    model = tiny(tmp_path_factory, "olmoe", "q8_0", tie_word_embeddings=True)
    net = hybrid(model, core, 0, "cpu")
    assert net.embedding is None and net.weights.output is net.weights.token_embd
