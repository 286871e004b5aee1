"""The routed experts' gate rows apart (pyruntime.experts.gates), which the C core's sparse pass
reads instead of every third row of the file.

- the kernel (pyrt_moe_ffn with pyrt_experts.gates), every weight format x SIMD level of this CPU,
  odd shapes, one token (the decode step's one-route path) and eight (chunks of several routes),
  1-3 threads: the same bits as without the copy, and against the plain reference (the dropped
  neurons exactly those under the threshold); with an expert map (slots); the copy is what the
  gates are read from (zeroed gates drop every neuron); wrong sizes refused in one line;
- the decoder: sparse decode steps give the same logits and counts with the copy as without;
  dense steps and prefill do not read it; the per-layer switch's cache tells the layouts apart,
  and the layers it leaves dense free their copies;
- when: on / off / auto (sparsity on and it fits in RAM, else a one-line warning).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_fixtures import make_tiny_hf_model
from test_cpu_core import FORMATS, assert_within, down_i8_of, kernel_x, make_case, reference

from pyruntime.converter import convert
from pyruntime.cpu import core as cpu_core
from pyruntime.cpu.decoder import CpuDecoder
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.errors import PyruntimeWarning, UsageError
from pyruntime.experts import gates
from pyruntime.experts.store import ExpertStore
from pyruntime.gguf.file import open_gguf
from pyruntime.gguf.quant import row_bytes


def copy_of(raw: np.ndarray, fmt: str, n_expert: int, n_ff: int, n_embd: int) -> np.ndarray:
    store = ExpertStore("t", FORMATS[fmt], n_expert, n_ff, n_embd, raw)
    return gates.gates_apart(store)


def threshold_near(abs_act: torch.Tensor, q: float) -> float:
    """A threshold in the widest gap between sorted |act| around quantile q, so no |act| lies
    near it (the kernel's f32 |act| falls on the reference's side)."""
    vals = abs_act.flatten().sort().values
    lo, hi = int((q - 0.1) * len(vals)), min(int((q + 0.05) * len(vals)), len(vals) - 1)
    gaps = vals[lo + 1 : hi + 1] - vals[lo:hi]
    i = lo + int(gaps.argmax())
    return float((vals[i] + vals[i + 1]) / 2)


def test_the_copy_holds_each_neurons_gate_row():
    raw, _, _, _, _, (n_expert, n_ff, n_embd) = make_case("Q8_0", 1, seed=2)
    out = copy_of(raw, "Q8_0", n_expert, n_ff, n_embd)
    rb = row_bytes(FORMATS["Q8_0"], n_embd)
    flat = raw.reshape(-1).view(np.uint8).reshape(n_expert, n_ff, 3, rb)
    assert out.shape == (n_expert, n_ff, rb) and out.flags.c_contiguous
    assert np.array_equal(out, flat[:, :, 0, :])
    assert out.ctypes.data % 4096 == 0  # its own anonymous pages
    assert gates.copy_bytes([ExpertStore("t", FORMATS["Q8_0"], n_expert, n_ff, n_embd, raw)]) == (
        out.nbytes
    )


# n_ff 211: several chunks of 32 neurons per work item (the software pipeline, the gate cursor
# running across chunks); 37: one chunk and a tail.
@pytest.mark.parametrize("n_tokens", [1, 8])
@pytest.mark.parametrize("n_ff", [37, 211])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sparse_with_the_copy_is_bitwise_the_same(cc, simd, fmt, n_ff, n_tokens):
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(fmt, n_tokens, seed=5, n_ff=n_ff)
    xk = kernel_x(fmt, x)
    _, _, abs_act, _ = reference(w, xk, ids, topk_w, "silu")
    copy = copy_of(raw, fmt, n_expert, n_ff, n_embd)
    for q in (0.85, 0.5):  # the reference check below at the last (0.5: no token drops all)
        threshold = threshold_near(abs_act, q)
        for threads in (1, 3):
            with cc.CpuCore(threads) as core:
                args = (raw, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w)
                plain, n_plain = core.moe_ffn(*args, threshold=threshold)
                apart, n_apart = core.moe_ffn(*args, threshold=threshold, gates=copy)
                dense, _ = core.moe_ffn(*args, gates=copy)  # dense: the copy is not read
                dense_plain, _ = core.moe_ffn(*args)
            assert n_apart == n_plain and torch.equal(apart, plain), f"{fmt} q={q} t={threads}"
            assert torch.equal(dense, dense_plain)
    i8 = down_i8_of(fmt, simd, raw, n_expert, n_ff, n_embd)
    ref, ref_active, _, bound = reference(
        w, xk, ids, topk_w, "silu", threshold, None, 3, down_i8=i8
    )
    assert n_apart == ref_active == int((abs_act >= threshold).sum())
    assert_within(apart, ref, bound, f"gates apart {fmt} T={n_tokens}")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "F32"])
def test_slots_of_an_expert_map_read_their_own_gates(cc, fmt):
    raw, w, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case(fmt, 6, seed=9, n_ff=67)
    held = [3, 0, 4]  # slot s holds expert held[s]
    emap = torch.full((n_expert,), -1, dtype=torch.int32)
    emap[held] = torch.arange(len(held), dtype=torch.int32)
    slots = np.ascontiguousarray(raw.reshape(n_expert, -1)[held])
    copy = copy_of(slots, fmt, len(held), n_ff, n_embd)
    _, _, abs_act, _ = reference(w, kernel_x(fmt, x), ids, topk_w, "silu")
    threshold = threshold_near(abs_act, 0.7)
    with cc.CpuCore(2) as core:
        args = (slots, FORMATS[fmt], n_expert, n_ff, n_embd, x, ids, topk_w)
        plain, n_plain = core.moe_ffn(*args, threshold=threshold, expert_map=emap)
        apart, n_apart = core.moe_ffn(*args, threshold=threshold, expert_map=emap, gates=copy)
    assert n_apart == n_plain > 0 and torch.equal(apart, plain)


def test_the_gates_are_read_from_the_copy(cc):
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 3, seed=4, n_ff=70)
    zeros = np.zeros_like(copy_of(raw, "Q8_0", n_expert, n_ff, n_embd))
    with cc.CpuCore(2) as core:
        args = (raw, FORMATS["Q8_0"], n_expert, n_ff, n_embd, x, ids, topk_w)
        y, n_active = core.moe_ffn(*args, threshold=1e-3, gates=zeros)  # silu(0) = 0: all off
        _, n_plain = core.moe_ffn(*args, threshold=1e-3)
    assert n_active == 0 and not y.any() and n_plain > 0


def test_a_copy_of_the_wrong_size_is_refused(cc):
    raw, _, x, ids, topk_w, (n_expert, n_ff, n_embd) = make_case("Q8_0", 2, seed=4)
    short = copy_of(raw, "Q8_0", n_expert, n_ff, n_embd)[:-1]
    with cc.CpuCore(1) as core, pytest.raises(cc.CoreError, match="gates hold .* bytes"):
        core.moe_ffn(raw, FORMATS["Q8_0"], n_expert, n_ff, n_embd, x, ids, topk_w,
                     threshold=0.01, gates=short)  # fmt: skip


# ---- the decoder --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gates")
    return convert(make_tiny_hf_model("mixtral", tmp / "hf"), tmp / "m.gguf", "q8_0", False)


def load(path, mode: str, threshold: float | None = 0.02) -> CpuExecutor:
    net = CpuExecutor.from_gguf(open_gguf(path), threads=2, expert_backend="c")
    if threshold is not None:
        net.expert_threshold = [threshold] * net.config.n_layer
    net.use_gate_copy(mode, model_bytes=0)
    return net


def run(net: CpuExecutor, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Prefill of 4 tokens, then decode steps: (all logits, neurons the steps kept)."""
    cache = net.new_cache(len(ids))
    rows = [net.forward(ids[:4], cache)]
    net.stats.reset()
    rows += [net.forward(ids[j : j + 1], cache) for j in range(4, len(ids))]
    return torch.cat(rows), net.stats.active


IDS = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(3))


def test_decode_logits_are_the_same_bits_with_the_copy(model):
    on, off = load(model, "on"), load(model, "off")
    stores = [b.experts for b in on.weights.blocks if b.experts is not None]
    assert on.gate_copy_bytes == gates.copy_bytes(stores) > 0 and off.gate_copy_bytes == 0
    got, active = run(on, IDS)
    want, want_active = run(off, IDS)
    assert torch.equal(got, want) and active == want_active
    assert 0 < active < on.stats.neurons  # sparse steps ran
    dense_on, dense_off = load(model, "on", None), load(model, "off", None)
    assert torch.equal(run(dense_on, IDS)[0], run(dense_off, IDS)[0])


def test_a_decoder_reads_its_gates_from_the_copy(model):
    net = load(model, "on")
    want, _ = run(load(model, "off"), IDS)
    for blk in net._decoder._model.weights.blocks[0 : net.config.n_layer]:
        if blk.gud_gates != net._decoder._ffi.NULL:
            net._decoder._ffi.memmove(blk.gud_gates, b"\0" * blk.gud_gates_bytes,
                                      blk.gud_gates_bytes)  # fmt: skip
    got, active = run(net, IDS)
    assert active == 0 and not torch.equal(got, want)


def test_a_decoder_refuses_a_copy_of_the_wrong_size(model):
    net = load(model, "off")
    layer = next(i for i, b in enumerate(net.weights.blocks) if b.experts is not None)
    short = gates.gates_apart(net.weights.blocks[layer].experts).reshape(-1)[:-1]
    with pytest.raises(cpu_core.CoreError, match=f"blk.{layer} gud_gates"):
        CpuDecoder(net.config, net.weights, net.core, gates={layer: short})


def test_the_switch_measures_each_layout_apart(model, tmp_path):
    from test_cpu_sparse_switch import SPARSE_WINS, fake_timer

    for mode in ("on", "off"):
        net = load(model, mode)
        calls: list = []
        net.choose_decode_sparsity("m", tmp_path, timer=fake_timer(
            [True] * net.config.n_layer, SPARSE_WINS, calls))  # fmt: skip
        assert calls  # measured: the other layout's record is not reused
    layouts = {json.loads(p.read_text())["identity"]["gates"] for p in tmp_path.glob("*.json")}
    assert layouts == {"apart", "file"}


def test_layers_the_switch_leaves_dense_free_their_copies(model, tmp_path):
    from test_cpu_sparse_switch import MIX_WINS, fake_timer

    net, plain = load(model, "on"), load(model, "off")
    wins = [i % 2 == 0 for i in range(net.config.n_layer)]
    for n in (net, plain):
        n.choose_decode_sparsity("m", tmp_path, timer=fake_timer(wins, MIX_WINS, []))
        assert n.sparse_layers == wins
    stores = [b.experts for i, b in enumerate(net.weights.blocks) if wins[i]]
    assert net.gate_copy_bytes == gates.copy_bytes(stores) > 0
    assert sorted(net._gate_copies) == [i for i, w in enumerate(wins) if w]
    got, active = run(net, IDS)
    want, want_active = run(plain, IDS)
    assert torch.equal(got, want) and active == want_active


# ---- when ---------------------------------------------------------------------------------------


def stores(n: int = 2) -> list[ExpertStore]:
    raw = np.zeros((4, 8, 3, 34), dtype=np.uint8)  # Q8_0 rows of 32 values
    return [ExpertStore("t", FORMATS["Q8_0"], 4, 8, 32, raw) for _ in range(n)]


def test_when_the_copy_is_made(recwarn):
    s, extra = stores(), 2 * 4 * 8 * 34
    assert gates.decide("on", False, s, 0, 0) is True
    assert gates.decide("off", True, s, 0, None) is False
    assert gates.decide("auto", False, s, 0, None) is False  # dense: no copy
    assert gates.decide("auto", True, [], 0, None) is False  # no routed experts
    room = extra + 100 + gates.HEADROOM_BYTES
    assert gates.decide("auto", True, s, 100, room) is True
    assert not recwarn.list
    with pytest.warns(PyruntimeWarning, match="not copying the experts' gate rows apart"):
        assert gates.decide("auto", True, s, 101, room) is False
    with pytest.raises(UsageError, match="gate_copy must be one of"):
        gates.decide("always", True, s, 0, None)


def test_mem_available_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:   42 kB\n")
    assert gates.mem_available(f) == 42 * 1024
    assert gates.mem_available(tmp_path / "none") is None
