"""Sparsity calibration: quantiles, the table's interpolation, its file, and the error paths."""

from __future__ import annotations

import pytest
import torch

from pyruntime.errors import ModelFileError, UsageError
from pyruntime.experts.sparsity import (
    TARGETS,
    GateHistogram,
    SparsityTable,
    _bin_counts,
    _quantile_from_cdf,
    check_sparsity,
    sidecar_path,
)


def test_histogram_quantiles_match_exact_quantiles():
    # |a| spread over several decades, as |silu(g)| is; the histogram's bins are 1.2% wide.
    a = torch.exp(torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 2.0)
    counts = _bin_counts(a)
    cum = torch.cumsum(counts, 0) / counts.sum()
    for s in (0.05, 0.5, 0.9, 0.95):
        exact = float(a.double().kthvalue(int(s * len(a))).values)
        got = _quantile_from_cdf(cum, s)
        assert got == pytest.approx(exact, rel=0.012)


def test_table_interpolates_and_round_trips(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 100)
    rows = [
        [0.01 * (k + 1) for k in range(len(TARGETS))],
        [0.1 * (k + 1) for k in range(len(TARGETS))],
    ]
    table = SparsityTable(list(TARGETS), rows, tokens=1000, source="t.txt", model_size=100)
    table.save(sidecar_path(model))
    loaded = SparsityTable.load(model)
    assert loaded.thresholds == rows
    assert loaded.for_sparsity(0.0) is None
    assert loaded.for_sparsity(0.05) == pytest.approx([0.01, 0.1 * 1])
    # halfway between the 0.05 and 0.10 entries
    assert loaded.for_sparsity(0.075) == pytest.approx([0.015, 0.15])
    # below the first target: linear from threshold 0 at sparsity 0
    assert loaded.for_sparsity(0.025) == pytest.approx([0.005, 0.05])


def test_errors(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    with pytest.raises(UsageError, match="pyruntime calibrate"):
        SparsityTable.load(model)
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(UsageError, match=r"\[0, 1\)"):
            check_sparsity(bad)
    SparsityTable(list(TARGETS), [[0.0] * len(TARGETS)], 1, "t", model_size=99).save(
        sidecar_path(model)
    )
    with pytest.raises(ModelFileError, match="calibrated on another file"):
        SparsityTable.load(model)
    sidecar_path(model).write_text("{not json")
    with pytest.raises(ModelFileError, match="bad sparsity calibration"):
        SparsityTable.load(model)


def test_gate_histogram_counts_routed_neurons():
    from gguf import GGMLQuantizationType

    from pyruntime.experts.store import ExpertStore

    n_expert, n_ff, n_embd = 3, 5, 32
    w = torch.randn(n_expert, n_ff, 3, n_embd)
    store = ExpertStore("t", GGMLQuantizationType.F32, n_expert, n_ff, n_embd, w.numpy())
    hist = GateHistogram(n_layer=1)
    ids = torch.tensor([[0, 2], [2, 1]])
    hist.observe(0, store, torch.randn(2, n_embd), ids, "silu")
    assert hist.samples() == [ids.numel() * n_ff]
