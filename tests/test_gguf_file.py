"""Our lazy GGUF header parser vs gguf.GGUFReader on converted files; bad-file errors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert
from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import open_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    hf = make_tiny_hf_model("qwen2moe", tmp / "hf")
    return [convert(hf, tmp / f"m-{t}.gguf", t, progress=False) for t in ("f32", "bf16", "q4_0")]


def _reader_value(field):
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def test_matches_gguf_reader(files):
    for path in files:
        ours, ref = open_gguf(path), GGUFReader(path)
        ref_meta = {k: _reader_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata.keys() == ref_meta.keys()
        for key, value in ref_meta.items():
            got = ours.metadata[key]
            if isinstance(value, float):
                assert got == pytest.approx(value, rel=1e-7), key
            else:
                assert list(got) == list(value) if isinstance(value, list) else got == value, key
        assert [t.name for t in ref.tensors] == list(ours.tensors)
        for t in ref.tensors:
            view = ours.tensors[t.name]
            assert view.qtype == t.tensor_type and view.n_bytes == t.n_bytes
            assert view.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
            assert view.data.dtype == t.data.dtype and view.data.shape == t.data.shape
            assert np.array_equal(view.data, t.data)


def test_truncated_and_foreign(files, tmp_path):
    data = files[0].read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 100, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match="truncated|corrupt"):
            open_gguf(bad)
    foreign = tmp_path / "x.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        open_gguf(foreign)
    with pytest.raises(ModelFileError, match="no such file"):
        open_gguf(tmp_path / "missing.gguf")


def test_in_ram_copy_matches_the_mapping(files):
    """in_ram (option weights_copy): the same header and tensor bytes as the mapped file, in
    read-only anonymous memory from a 2 MiB boundary, not a view of the file."""
    for path in files:
        mapped, copy = open_gguf(path), open_gguf(path, in_ram=True)
        assert copy.metadata.keys() == mapped.metadata.keys()
        assert copy.header_sha256() == mapped.header_sha256()
        assert not isinstance(copy._map, np.memmap) and not copy._map.flags.writeable
        assert copy._map.ctypes.data % (2 << 20) == 0
        assert list(copy.tensors) == list(mapped.tensors)
        for name, view in mapped.tensors.items():
            got = copy.tensors[name].data
            assert got.dtype == view.data.dtype and np.array_equal(got, view.data), name


def test_model_from_the_copy_gives_the_mapped_logits(files):
    """pyruntime.Model(weights_copy=True) runs from the copy: the CPU logits of a prompt are
    the mapped file's, bit for bit (the same bytes, the same kernels)."""
    from pyruntime.api import Model

    path = files[2]  # q4_0
    ids = [1, 5, 9, 2, 7, 3]
    mapped = Model(path, device="cpu", threads=1).logits(ids)
    copy = Model(path, device="cpu", threads=1, weights_copy=True)
    assert not isinstance(copy.file._map, np.memmap)
    assert np.array_equal(copy.logits(ids), mapped)
