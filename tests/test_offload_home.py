"""The experts' homes on the host (pyruntime.offload.home) and the slots they fill
(pyruntime.offload.slots): the bytes each home hands out, what it locks and unlocks, and a
refused pin falling back to bounce buffers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gpu_device import DEVICE
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.errors import PyruntimeWarning
from pyruntime.gguf.file import open_gguf
from pyruntime.kernels.expert_formats import repack_rows
from pyruntime.model.config import ModelConfig
from pyruntime.model.weights import HostWeights
from pyruntime.offload.home import PAGE, BounceHome, open_home
from pyruntime.offload.host_register import SharedRegistration
from pyruntime.offload.slots import ExpertSlots
from pyruntime.offload.streams import DeviceStreams

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def host(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"home-{request.param}")
    hf = make_tiny_hf_model("olmoe", tmp / "hf")
    f = open_gguf(convert(hf, tmp / "m.gguf", request.param, progress=False))
    cfg = ModelConfig.from_gguf(f)
    return request.param, HostWeights.from_gguf(f, cfg)


class RecordingPinning:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.pinned, self.unpinned = refuse, [], []

    def pin(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        if self.refuse:
            return "invalid argument"
        self.pinned.append((ptr, nbytes, read_only))
        return None

    def unpin(self, ptr: int) -> None:
        self.unpinned.append(ptr)


def expert_bytes(host: HostWeights, layer: int, e: int) -> np.ndarray:
    return host.blocks[layer].experts.raw[e].reshape(-1).view(np.uint8)


@pytest.mark.parametrize("staging", ["register", "bounce", "pinned"])
def test_every_home_hands_out_the_experts_bytes(host, staging):
    _, weights = host
    home = open_home(weights, CPU, staging, RecordingPinning())
    assert home.mode == staging
    keys = [(1, 3), (0, 0), (1, 7)]
    for (layer, e), src in zip(keys, home.sources(keys), strict=True):
        assert src.dtype == torch.uint8 and np.array_equal(
            src.numpy(), expert_bytes(weights, layer, e)
        )
    for layer in (0, 1):
        view = home.cpu_view(layer)
        raw = weights.blocks[layer].experts.raw
        assert view.shape == raw.shape and view.dtype == raw.dtype and np.array_equal(view, raw)
        assert view.flags.c_contiguous
    home.close()
    home.close()


def test_register_locks_the_page_span_of_the_expert_tensors_read_only(host):
    _, weights = host
    pinning = RecordingPinning()
    home = open_home(weights, CPU, "register", pinning)
    [(ptr, nbytes, read_only)] = pinning.pinned
    raws = [b.experts.raw for b in weights.blocks]
    assert read_only and ptr % PAGE == 0 and nbytes % PAGE == 0
    assert ptr <= min(r.ctypes.data for r in raws)
    assert ptr + nbytes >= max(r.ctypes.data + r.nbytes for r in raws)
    home.close()
    assert pinning.unpinned == [ptr]


def test_pinned_copies_each_layer_to_page_aligned_memory_and_unpins_it(host):
    _, weights = host
    pinning = RecordingPinning()
    home = open_home(weights, CPU, "pinned", pinning)
    assert [p % PAGE for p, _, ro in pinning.pinned] == [0, 0]
    assert not any(ro for _, _, ro in pinning.pinned)
    assert home.cpu_view(0).ctypes.data != weights.blocks[0].experts.raw.ctypes.data  # a copy
    home.close()
    assert sorted(pinning.unpinned) == sorted(p for p, _, _ in pinning.pinned)


@pytest.mark.parametrize("staging", ["register", "pinned"])
def test_a_refused_pin_falls_back_to_bounce_buffers(host, staging):
    _, weights = host
    with pytest.warns(
        PyruntimeWarning,
        match="refused \\(invalid argument\\): staging experts through pinned bounce buffers",
    ):
        home = open_home(weights, CPU, staging, RecordingPinning(refuse=True))
    assert isinstance(home, BounceHome)
    with pytest.raises(ValueError, match="unknown staging"):
        open_home(weights, CPU, "mmap")


def test_slots_hold_the_experts_in_the_kernels_format(host):
    """Filled in one batch, across batches of the staging buffer, into any slots: each slot
    holds its expert's GGUF bytes, repacked for q8_0. On the test device (the repack is a
    Triton kernel: the GPU where there is one)."""
    fmt, weights = host
    store = weights.blocks[0].experts
    device = torch.device(DEVICE)
    slots = ExpertSlots(5, store.n_ff, store.n_embd, fmt, device, DeviceStreams(device),
                        staging_buffer=2)  # fmt: skip
    assert slots.format == {"f32": "f32", "q8_0": "q8_0r"}[fmt]
    home = open_home(weights, device, "bounce")
    keys = [(0, 5), (1, 2), (0, 0)]
    slots.fill([4, 1, 2], home.sources(keys))

    def held(slot: int, layer: int, e: int) -> bool:
        want = torch.from_numpy(weights.blocks[layer].experts.raw[e].copy()).to(device)
        return torch.equal(slots.tensor[slot], repack_rows(want, fmt) if fmt == "q8_0" else want)

    assert all(held(s, layer, e) for s, (layer, e) in zip([4, 1, 2], keys, strict=True))
    slots.fill([0, 1], home.sources([(1, 7), (1, 6)]))  # consecutive slots, one batch
    assert held(0, 1, 7) and held(1, 1, 6) and held(2, 0, 0) and held(4, 0, 5)
    assert not held(1, 1, 2)


# -- registrations shared by every home over one mapping ---------------------------------------


class RecordingDriver:
    def __init__(self, refuse_at: int | None = None) -> None:
        self.live: dict[int, tuple[int, bool]] = {}  # start -> (end, read_only)
        self.refuse_at = refuse_at

    def register(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
        if ptr == self.refuse_at:
            return "out of memory"
        assert all(ptr + nbytes <= s or e <= ptr for s, (e, _) in self.live.items()), "overlap"
        self.live[ptr] = (ptr + nbytes, read_only)
        return None

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def test_one_registration_per_range_shared_by_its_users():
    """Two homes over one mapping pin the same span: the driver registers it once (a second
    registration of an overlapping range is refused by CUDA), and unregisters it after the
    last user lets go; a wider span registers only what no range covers yet."""
    driver = RecordingDriver()
    shared = SharedRegistration(driver)
    assert shared.pin(0x10000, 0x4000, read_only=True) is None
    assert shared.pin(0x10000, 0x4000, read_only=True) is None
    assert driver.live == {0x10000: (0x14000, True)}
    assert shared.pin(0xE000, 0x8000, read_only=True) is None  # both sides of the first
    assert driver.live == {0xE000: (0x10000, True), 0x10000: (0x14000, True),
                           0x14000: (0x16000, True)}  # fmt: skip
    shared.unpin(0x10000)
    shared.unpin(0xE000)
    assert shared.registered() == [(0x10000, 0x14000)]
    shared.unpin(0x10000)
    assert driver.live == {} and shared.registered() == []
    shared.unpin(0x10000)  # nothing left to let go: a no-op


def test_an_unpin_from_inside_a_section_runs_at_its_end():
    """A cyclic collection inside a section (any allocation may start one) can finalize a
    dropped executor, whose close() unpins on the same thread: that unpin waits for the
    outermost section's end instead of for the thread itself (a plain lock hung the GPU test
    set in cuts()). Played by a driver whose register unpins another span, as a finalizer
    would; in a thread, so that a regression fails instead of hanging."""
    shared = SharedRegistration(RecordingDriver())
    assert shared.pin(0x10000, 0x1000, read_only=True) is None

    class Finalizing(RecordingDriver):
        def register(self, ptr: int, nbytes: int, read_only: bool) -> str | None:
            shared.unpin(0x10000)  # a dropped executor's close(), mid-section
            assert shared.registered() == [(0x10000, 0x11000)]  # not yet: after the section
            return super().register(ptr, nbytes, read_only)

    driver = Finalizing()
    driver.live = shared.driver.live
    shared.driver = driver
    result: list = []
    worker = threading.Thread(target=lambda: result.append(shared.pin(0x20000, 0x1000, True)),
                              daemon=True)  # fmt: skip
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the section's own thread waited for itself"
    assert result == [None]
    assert driver.live == {0x20000: (0x21000, True)}
    assert shared.registered() == [(0x20000, 0x21000)]


def test_a_refused_part_leaves_nothing_registered():
    driver = RecordingDriver(refuse_at=0x12000)  # the second gap
    shared = SharedRegistration(driver)
    assert shared.pin(0x10000, 0x2000, read_only=True) is None
    assert shared.pin(0xE000, 0x8000, read_only=True) == "out of memory"
    assert shared.registered() == [(0x10000, 0x12000)] and list(driver.live) == [0x10000]
    assert "read-only" in shared.pin(0x11000, 0x1000, read_only=False)
    shared.unpin(0x10000)
    assert driver.live == {}


def test_uploads_are_cut_where_a_registered_range_starts_or_ends(monkeypatch):
    """CUDA refuses a copy from host memory that starts inside a registered range and runs past
    its end ("invalid argument", seen on the H100 when a second executor uploaded a tensor
    sharing a page with the experts' registered span): the upload of a mapped view is made in
    pieces cut at every range edge inside it, and its bytes are those of the view."""
    from pyruntime.gpu import weights as gpu_weights
    from pyruntime.offload import host_register

    data = np.arange(3 * PAGE, dtype=np.uint8)
    base = data.ctypes.data
    shared = SharedRegistration(RecordingDriver())
    assert shared.pin(base + PAGE // 2, PAGE, read_only=True) is None
    assert shared.cuts(base, data.nbytes) == [PAGE // 2, PAGE // 2 + PAGE]
    assert shared.cuts(base + PAGE, PAGE) == [PAGE // 2]  # starts inside: cut at the end
    assert shared.cuts(base + 2 * PAGE, PAGE) == []  # wholly outside
    monkeypatch.setattr(host_register, "_shared", shared)
    pieces: list[int] = []
    copy = torch.Tensor.copy_

    def recording_copy(dst, src, *a, **kw):
        pieces.append(src.numel())
        return copy(dst, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    out = gpu_weights._bytes_on(data[PAGE:], torch.device("cpu"))
    assert pieces == [PAGE // 2, PAGE + PAGE // 2]
    assert np.array_equal(out.numpy(), data[PAGE:])
