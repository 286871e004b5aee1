"""Expert handles (one (layer, expert) on the host) and residency (which sit in device slots)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.experts.store import Residency
from pyruntime.gguf.file import open_gguf
from pyruntime.model.config import ModelConfig
from pyruntime.model.weights import HostWeights


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_handles_are_the_experts_bytes_in_place(tmp_path, outtype):
    path = convert(make_tiny_hf_model("olmoe", tmp_path / "hf"), tmp_path / "m.gguf", outtype,
                   progress=False)  # fmt: skip
    f = open_gguf(path)
    cfg = ModelConfig.from_gguf(f)
    w = HostWeights.from_gguf(f, cfg)
    for layer, blk in enumerate(w.blocks):
        store = blk.experts
        whole = store.raw_bytes()
        assert store.layer == layer
        for e in range(cfg.n_expert):
            h = w.expert(layer, e)
            assert (h.layer, h.expert, h.nbytes) == (layer, e, store.expert_bytes)
            lo = e * store.expert_bytes
            assert np.array_equal(h.data, whole[lo : lo + store.expert_bytes])
            assert h.data.ctypes.data == whole.ctypes.data + lo  # a view of the mmap, no copy
    with pytest.raises(IndexError):
        w.expert(0, cfg.n_expert)


def test_residency_tracks_slots_and_builds_expert_maps():
    r = Residency(n_layer=2, n_expert=5, n_slots=3)
    assert r.expert_map(0).tolist() == [-1] * 5
    r.place(0, 4, 0)
    r.place(1, 2, 1)
    assert r.expert_map(0).tolist() == [-1, -1, -1, -1, 0]
    assert r.holder(1) == (1, 2) and r.slot(1, 2) == 1
    r.place(0, 1, 1)  # slot 1 is reused: (1, 2) is no longer resident
    assert r.slot(1, 2) == -1 and r.expert_map(1).tolist() == [-1] * 5
    r.place(0, 4, 2)  # an expert moved to another slot frees its old one
    assert r.holder(0) is None and r.slot(0, 4) == 2
    r.evict(0, 4)
    assert r.slot(0, 4) == -1 and r.holder(2) is None
    m = r.expert_map(0)
    m[0] = 7  # a copy: the caller may hand it to a kernel and keep placing experts
    assert r.slot(0, 0) == -1
    with pytest.raises(IndexError):
        r.place(0, 0, 3)
