"""The GPU budget: what a model needs by part (pyruntime.offload.plan), where it runs under a
budget (pyruntime.placement, with a GPU faked through torch.cuda's queries), --gpu-mem on the
command line and `pyruntime info`'s plan, and the hybrid loaded through pyruntime.Model (on the
CPU device standing in for the GPU, its costs measured and cached)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from gguf import GGMLQuantizationType
from gpu_device import DEVICE
from hf_fixtures import make_tiny_hf_model

from pyruntime import cli, options
from pyruntime.converter import convert
from pyruntime.errors import DeviceMemoryError, PyruntimeWarning, UsageError
from pyruntime.gguf.file import open_gguf
from pyruntime.gguf.quant import FORMAT_NAMES
from pyruntime.gpu.weights import dense_dtype_for
from pyruntime.kernels.expert_formats import row_bytes
from pyruntime.model.config import ModelConfig
from pyruntime.offload.plan import (
    DeviceBytes,
    activation_itemsize,
    device_bytes,
    gib,
    plan_budget,
)
from pyruntime.placement import DEFAULT_MARGIN, allocatable_bytes, choose_device

MIB = 1 << 20


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    hf = make_tiny_hf_model("olmoe", tmp / "hf", tie_word_embeddings=True)
    path = convert(hf, tmp / "m.gguf", "q8_0", progress=False)
    f = open_gguf(path)
    return path, f, ModelConfig.from_gguf(f)


def test_device_bytes_by_part(q8):
    _, f, cfg = q8
    need = device_bytes(f, cfg, 100)
    experts = [t for t in f.tensors.values() if t.name.endswith("ffn_gud_exps.weight")]
    assert need.experts == sum(t.n_bytes for t in experts)
    assert need.n_experts == 2 * cfg.n_expert and need.expert_format == "q8_0"
    assert need.expert_bytes * need.n_experts == need.experts
    assert need.kv == cfg.n_layer * 2 * cfg.n_head_kv * 100 * cfg.head_dim * 2  # bf16
    assert need.whole == need.fixed + need.experts
    assert device_bytes(f, cfg, 200).kv == 2 * need.kv


def test_mxfp4_experts_count_their_padded_device_rows(tmp_path):
    """MXFP4 experts take the device as mxfp4r, rows padded to 16 bytes: the slots and the
    whole model count those bytes, not the GGUF's; and they are staged (a repack buffer)."""
    hf = make_tiny_hf_model("gptoss", tmp_path / "hf", tie_word_embeddings=True)
    f = open_gguf(convert(hf, tmp_path / "m.gguf", "mxfp4", progress=False))
    cfg = ModelConfig.from_gguf(f)
    need = device_bytes(f, cfg, 100)
    experts = [t for t in f.tensors.values() if t.name.endswith("ffn_gud_exps.weight")]
    n_ff = experts[0].n_bytes // experts[0].shape[0] // 3 // row_bytes("mxfp4", cfg.n_embd)
    assert need.expert_format == "mxfp4" and row_bytes("mxfp4r", cfg.n_embd) % 16 == 0
    assert need.expert_bytes == n_ff * 3 * row_bytes("mxfp4r", cfg.n_embd)
    assert need.expert_bytes > experts[0].n_bytes // experts[0].shape[0]  # padded rows
    assert need.experts == need.expert_bytes * need.n_experts
    assert plan_budget(need, need.fixed + 4 * need.expert_bytes, 64).staging_buffer == 2


@pytest.mark.parametrize("qtype", list(GGMLQuantizationType)[:12])
def test_activation_size_is_the_gpu_executors_dtype(qtype):
    assert activation_itemsize(qtype) == dense_dtype_for(qtype).itemsize


def need_of(n_experts=100, expert=10 * MIB, fmt="q8_0", k=8) -> DeviceBytes:
    return DeviceBytes(dense=300 * MIB, experts=n_experts * expert, kv=50 * MIB, work=150 * MIB,
                       expert_bytes=expert, n_experts=n_experts, expert_format=fmt,
                       n_expert_used=k)  # fmt: skip


def test_a_budget_is_spent_on_the_whole_model_or_on_slots():
    need = need_of()
    whole = plan_budget(need, need.whole, 512)
    assert whole.whole_model and whole.resident_share == 1.0 and whole.staging_buffer == 0
    hybrid = plan_budget(need, need.fixed + 40 * MIB + 5, 512)
    # q8_0: 4 experts' room, half of it (2) a staging buffer for repacking, 2 slots
    assert (hybrid.slots, hybrid.staging_buffer) == (2, 2) and not hybrid.whole_model
    assert hybrid.resident_share == pytest.approx(0.02)
    f32 = plan_budget(need_of(fmt="f32"), need.fixed + 40 * MIB, 512)
    assert (f32.slots, f32.staging_buffer) == (4, 0)  # copied straight into their slots
    assert plan_budget(need, need.fixed + 15 * MIB, 512).slots == 0  # one expert's room: none
    big = plan_budget(need, need.fixed + 500 * MIB, 512)
    assert (big.slots, big.staging_buffer) == (42, 8)
    rows = dict(big.rows())
    assert rows["expert slots"].startswith("42 (420.0 MiB, + 8 experts' staging buffer)")
    assert rows["experts resident"] == "42.0% of all routed experts"
    assert "42 of 100 routed experts" in big.summary("cuda:0")


def test_an_untied_embedding_in_host_memory_leaves_its_bytes_to_slots(tmp_path, capsys):
    """The hybrid's fixed part leaves out an untied token_embd (it stays in host memory), so a
    budget just below the whole model holds every expert; `info` says where it lives."""
    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", tie_word_embeddings=False)
    path = convert(hf, tmp_path / "m.gguf", "q8_0", progress=False)
    f = open_gguf(path)
    need = device_bytes(f, ModelConfig.from_gguf(f), 128)
    assert need.embedding == f.tensor("token_embd.weight").n_bytes  # Q8_0: its GGUF bytes
    assert need.whole == need.fixed + need.embedding + need.experts
    almost = plan_budget(need, need.whole - 1, 128)
    assert not almost.whole_model and almost.slots == need.n_experts
    assert "dense weights (the token embedding in host memory) and KV" in almost.summary("gpu")
    budget = need.fixed + 5 * need.expert_bytes
    assert cli.main(["info", str(path), "--gpu-mem", str(budget), "-c", "128"]) == 0
    out = capsys.readouterr().out
    assert f"token embedding       : {gib(need.embedding)} in host memory" in out
    assert f"dense weights         : {gib(need.hybrid_dense)} (GPU)" in out
    assert cli.main(["info", str(path), "--gpu-mem", "1G", "-c", "128"]) == 0
    out = capsys.readouterr().out
    assert f"token embedding       : {gib(need.embedding)} on the GPU (in the dense" in out
    assert f"dense weights         : {gib(need.dense)} (GPU)" in out


def test_a_budget_below_the_dense_part_says_how_much_is_needed():
    need = need_of()
    with pytest.raises(DeviceMemoryError) as err:
        plan_budget(need, 100 * MIB, 4096, "12.0 MiB is free on Tiny GPU")
    msg = str(err.value)
    assert "\n" not in msg and "need 500.0 MiB of GPU memory" in msg
    assert "the budget is 100.0 MiB (12.0 MiB is free on Tiny GPU)" in msg
    assert "4096-token KV cache" in msg and "--gpu-mem" in msg
    dense_model = dataclasses.replace(need, experts=0, expert_bytes=0, n_experts=0)
    with pytest.raises(DeviceMemoryError, match="no routed experts to keep in host memory"):
        plan_budget(dense_model, need.fixed - 1, 512)
    assert plan_budget(dense_model, need.fixed, 512).whole_model


# -- placement --------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda answering as a GPU with `free` bytes free (settable) and nothing in torch's
    cache (on a real GPU the tests before may have left some, which the budget counts)."""
    state = {"free": 80 << 30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (state["free"], 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tiny GPU")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda dev=None: 1.0)
    return state


def test_auto_and_cuda_run_whole_or_hybrid_by_the_budget(q8, fake_gpu):
    _, f, cfg = q8
    need = device_bytes(f, cfg, 64)
    for device in ("auto", "cuda"):
        assert choose_device(device, f, cfg, 64).plan is None  # 80 GiB free: the whole model
        choice = choose_device(device, f, cfg, 64, gpu_mem=need.fixed + 6 * need.expert_bytes)
        assert choice.device == "cuda" and choice.hybrid
        assert (choice.plan.slots, choice.plan.staging_buffer) == (4, 2)
    assert choose_device("cpu", f, cfg, 64, gpu_mem=1).device == "cpu"
    fake_gpu["free"] = need.fixed + DEFAULT_MARGIN + 3 * need.expert_bytes  # default budget
    assert choose_device("auto", f, cfg, 64).plan.slots == 2


def test_a_budget_too_small_takes_the_cpu_or_fails(q8, fake_gpu):
    _, f, cfg = q8
    choice = choose_device("auto", f, cfg, 64, gpu_mem=MIB)
    assert choice.device == "cpu" and choice.note.startswith("running on the CPU: ")
    assert "the budget is 1.0 MiB (--gpu-mem)" in choice.note
    with pytest.raises(DeviceMemoryError, match="^--device cuda: the dense weights"):
        choose_device("cuda", f, cfg, 64, gpu_mem=MIB)
    with pytest.raises(UsageError, match="gpu_mem must be a number of bytes"):
        choose_device("auto", f, cfg, 64, gpu_mem=-1)


def test_a_budget_above_what_can_be_allocated_is_lowered_with_a_warning(q8, fake_gpu):
    _, f, cfg = q8
    fake_gpu["free"] = 2 << 30
    with pytest.warns(
        PyruntimeWarning,
        match="--gpu-mem 64.00 GiB is more than torch can "
        "allocate now: 2.00 GiB is free on Tiny GPU",
    ):
        choice = choose_device("cuda", f, cfg, 64, gpu_mem=64 << 30)
    assert choice.plan is None  # the tiny model fits the 1.5 GiB left


def test_the_budget_counts_torchs_own_cap_not_just_the_drivers_free_memory(monkeypatch):
    """set_per_process_memory_fraction caps torch below what the driver reports free: the
    budget must come from the cap (loading would otherwise die in an out-of-memory error)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (70 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 6 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 5 << 30)

    def fraction(value):  # torch's refuses torch.device("cuda"), without an index (ValueError)
        def get(dev=None):
            if isinstance(dev, torch.device) and dev.index is None:
                raise ValueError(f"Expected a torch.device with a specified index, got {dev}")
            return value

        return get

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction(0.25))
    # may still reserve 20 - 6 = 14 GiB, plus 1 GiB cached and free in torch's pool
    assert allocatable_bytes(torch.device("cuda")) == 15 << 30
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction(1.0))
    assert allocatable_bytes(torch.device("cuda")) == 71 << 30
    assert allocatable_bytes(torch.device("cuda", 0)) == 71 << 30


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, n",
    [
        ("12G", 12 << 30),
        ("8GiB", 8 << 30),
        ("512M", 512 * MIB),
        ("1.5g", 3 << 29),
        ("4096", 4096),
        ("2 GB", 2 << 30),
    ],
)
def test_sizes(text, n):  # fmt: skip
    assert options.parse_size(text) == n


def test_gpu_mem_flag(q8, capsys):
    path, f, cfg = q8
    need = device_bytes(f, cfg, 128)
    budget = need.fixed + 5 * need.expert_bytes
    assert cli.main(["info", str(path), "--gpu-mem", str(budget), "-c", "128"]) == 0
    out = capsys.readouterr().out
    assert "KV cache (128 tokens)" in out and "placement             : hybrid" in out
    assert "expert slots          : 3 (" in out and "18.8% of all routed experts" in out
    assert "token embedding       : on the GPU (tied: the lm_head's weights)" in out
    assert cli.main(["info", str(path), "--gpu-mem", "1G"]) == 0
    assert "the whole model on the GPU" in capsys.readouterr().out
    assert cli.main(["info", str(path), "--gpu-mem", "1M"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("error: the dense weights") and err.count("\n") == 1
    assert "architecture" in out and out.splitlines()[-1].startswith("gpu plan")  # the file too
    with pytest.raises(SystemExit):
        cli.main(["generate", str(path), "-p", "x", "--gpu-mem", "12X"])
    assert "'12X' is not a size" in capsys.readouterr().err


# -- the hybrid through pyruntime.Model ---------------------------------------------------------


def greedy(model) -> str:
    return "".join(model.generate("The hacker wrote", max_tokens=8, temp=0, ignore_eos=True))


def hybrid_model(tmp_path, monkeypatch, n_slots: int):
    """(path, expert sizes, the CPU executor's greedy text, a Model whose placement is forced to
    a plan of n_slots expert slots on DEVICE), a tiny f32 olmoe (2 MoE layers, top-2), the
    offload costs cached under tmp_path/cache."""
    from pyruntime import api, placement
    from pyruntime.api import Model

    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", tie_word_embeddings=True)
    path = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    f = open_gguf(path)
    need = device_bytes(f, ModelConfig.from_gguf(f), 64)
    plan = plan_budget(need, need.fixed + n_slots * need.expert_bytes, 64)
    want = greedy(Model(path, n_ctx=64, seed=0, device="cpu"))
    monkeypatch.setattr(api, "choose_device",
                        lambda *a, **k: placement.DeviceChoice(DEVICE, None, plan))  # fmt: skip
    monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path / "cache"))
    return path, need, want, Model(path, n_ctx=64, seed=0)


def test_model_loads_hybrid_measures_its_costs_once_and_reports_them(tmp_path, monkeypatch,
                                                                     capsys, cc):  # fmt: skip
    """A plan that does not hold every expert gives the hybrid (on tests/gpu_device.py's DEVICE:
    the CPU device stands in for the GPU under the interpreter): with transit slots (3, fewer
    than a token's 2 x 2 experts) its costs are measured once per staging mode and cached, its
    greedy text is the CPU executor's, and Model.stats() carries the slot hits and bytes it
    moved."""
    from pyruntime.api import Model

    path, need, want, m = hybrid_model(tmp_path, monkeypatch, 3)
    err = capsys.readouterr().err
    hybrid = f"hybrid on {DEVICE}: dense weights and KV cache on the GPU, 3 of 16 routed experts"
    assert hybrid in err
    assert "measuring the offload costs" in err
    costs = m.net.costs
    assert costs.pcie_gbs > 0 and costs.cpu_expert_s >= 0 and costs.expert_bytes > 0
    [saved] = (tmp_path / "cache" / "offload").glob("costs-*.json")
    assert json.loads(saved.read_text())["costs"]["expert_bytes"] == costs.expert_bytes
    assert greedy(m) == want
    stats = m.stats()["offload"]
    assert stats["slots"] == 3 and stats["slot_hits"] + stats["slot_misses"] > 0
    assert stats["staged_bytes"] == stats["staged_experts"] * need.expert_bytes
    assert set(stats["seconds_per_token"]) >= {"attention", "router", "gpu_experts",
                                               "copy_wait", "cpu_experts", "sampling"}  # fmt: skip
    Model(path, n_ctx=64, seed=0, staging="bounce")
    assert "measuring" in capsys.readouterr().err  # another staging mode: its own costs
    again = Model(path, n_ctx=64, seed=0)
    assert "measuring" not in capsys.readouterr().err and again.net.costs == costs


def test_a_plan_whose_slots_cache_measures_no_costs(tmp_path, monkeypatch, capsys, cc):
    """Slots that hold a token's experts in every MoE layer (4 = 2 layers x top-2) are a cache,
    where auto stages every miss: nothing to measure at load, and the greedy text is the CPU
    executor's."""
    _, _, want, m = hybrid_model(tmp_path, monkeypatch, 4)
    assert "measuring" not in capsys.readouterr().err and m.net.costs is None
    assert not (tmp_path / "cache" / "offload").exists()
    assert greedy(m) == want
    assert m.stats()["offload"]["cpu_experts"] == 0


# -- out of memory ------------------------------------------------------------------------------


def test_out_of_memory_while_loading_is_one_line_and_frees_what_was_built():
    import weakref

    from pyruntime.offload.loading import device_memory_guard

    built = []

    def load():
        partial = torch.zeros(1000)  # a tensor of the half-built model
        built.append(weakref.ref(partial))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(DeviceMemoryError) as err:
        with device_memory_guard("loading the model", "cuda:0", 8 << 30):
            load()
    msg = str(err.value)
    assert msg.startswith("the GPU ran out of memory loading the model on cuda:0 within a budget "
                          "of 8.00 GiB: lower --gpu-mem") and "\n" not in msg  # fmt: skip
    assert built[0]() is None  # freed, not held by the traceback


def test_the_cli_reports_a_gpu_out_of_memory_in_one_line(q8, monkeypatch, capsys):
    from pyruntime import api

    path, _, _ = q8

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB\nmore")

    monkeypatch.setattr(api.Model, "generate", oom)
    assert cli.main(["generate", str(path), "-p", "Hi", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: the GPU ran out of memory (CUDA out of memory. Tried to allocate "
                   "20.00 MiB): lower --gpu-mem or --ctx-size, or use --device cpu\n")  # fmt: skip


# -- the plan vs what the upload allocates --------------------------------------------------------


def device_tensor_bytes(weights) -> int:
    """Bytes of the distinct tensors in a DeviceWeights (walked through its dataclasses, lists
    and tuples; a tensor shared by two fields, e.g. a tied lm_head, counted once)."""
    seen: dict[int, int] = {}

    def walk(v):
        if isinstance(v, torch.Tensor):
            seen[v.data_ptr()] = max(seen.get(v.data_ptr(), 0), v.numel() * v.element_size())
        elif dataclasses.is_dataclass(v):
            for field in dataclasses.fields(v):
                walk(getattr(v, field.name))
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(weights)
    return sum(seen.values())


@pytest.mark.parametrize(
    "arch, outtype, tied",
    [
        ("olmoe", "q8_0", True),
        ("olmoe", "q8_0", False),
        ("olmoe", "f32", True),
        ("olmoe", "f16", False),
        ("gptoss", "mxfp4", False),
        ("qwen35moe", "q4_0", True),
        ("deepseek2", "q8_0", False),
        ("llama4", "bf16", True),
    ],
)
def test_the_dense_estimate_is_what_the_upload_allocates(tmp_path, arch, outtype, tied):
    """need.dense is, byte for byte, what upload_weights puts on the device beside the routed
    experts (on the CPU device standing in for the GPU); the embedding is there once."""
    from pyruntime.gpu.weights import first_matrix_type, upload_weights
    from pyruntime.model.weights import HostWeights

    hf = make_tiny_hf_model(arch, tmp_path / "hf", tie_word_embeddings=tied)
    f = open_gguf(convert(hf, tmp_path / "m.gguf", outtype, progress=False))
    cfg = ModelConfig.from_gguf(f)
    host = HostWeights.from_gguf(f, cfg)
    dtype = dense_dtype_for(first_matrix_type(host))
    weights = upload_weights(host, cfg, torch.device("cpu"), dtype, routed_experts=False)
    need = device_bytes(f, cfg, 64)
    assert device_tensor_bytes(weights) == need.dense
    assert (weights.output is weights.token_embd) == tied
    # the hybrid's upload: an untied embedding stays in host memory (pyruntime.offload.embedding)
    hybrid = upload_weights(host, cfg, torch.device("cpu"), dtype, routed_experts=False,
                            token_embd=tied)  # fmt: skip
    assert device_tensor_bytes(hybrid) == need.hybrid_dense
    assert (need.embedding == 0) == tied and (hybrid.token_embd is None) == (not tied)


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of tensor storage alive at once while the mode is on, counting the
    storages torch ops return (a tensor made from host memory without an op, e.g. the CPU
    stand-in's view of the mmap, is counted once an op returns a view of it: on a GPU it is a
    copy)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils import _pytree

        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in _pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize(
    "fmt", ["f32", "f16", "bf16", "q8_0", "q4_0", "mxfp4", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_upload_converts_in_chunks_within_the_work_reserve(fmt, dtype, monkeypatch):
    """A matrix the upload converts (pyruntime.gpu.weights.upload_linear / upload_dense) goes
    through in chunks of LOAD_CHUNK_ELEMENTS weights: the result is the whole conversion's, and
    the memory it takes beside the result stays within LOAD_BYTES_PER_ELEMENT a chunk's weight
    (the part of plan.WORK_BYTES reserved for it), whatever the matrix's size."""
    from pyruntime.gguf.quant import QuantMatrix
    from pyruntime.gpu import weights
    from pyruntime.kernels.expert_formats import quantize_rows
    from pyruntime.kernels.q8_linear import dequantize_q8
    from pyruntime.offload.plan import LOAD_BYTES_PER_ELEMENT, WORK_BYTES

    n_out, n_in = 61, 512  # 61 rows: 16 chunks of 4 rows, the last one short
    chunk = 4 * n_in
    monkeypatch.setattr(weights, "LOAD_CHUNK_ELEMENTS", chunk)
    raw = quantize_rows(torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(3)), fmt)
    qtype = next(q for q, name in FORMAT_NAMES.items() if name == fmt)
    m = QuantMatrix("t", qtype, (n_out, n_in), raw.view(torch.uint8).numpy())
    with LiveBytes() as live:
        lin = weights.upload_linear(m, torch.device("cpu"), dtype)
        result = lin.nbytes
    want = m.dequantize()
    if lin.w is None:
        assert torch.equal(dequantize_q8(lin.q, lin.d, torch.float32), want)
    else:
        assert lin.w.dtype == dtype and torch.equal(lin.w, want.to(dtype))
    assert live.peak - result <= chunk * LOAD_BYTES_PER_ELEMENT
    assert WORK_BYTES >= weights.LOAD_CHUNK_ELEMENTS * LOAD_BYTES_PER_ELEMENT + (256 << 20)
