"""bench/offload.py end to end at toy size, on the GPU or (CI) with torch's CPU device standing
in for it: every row of its matrix printed with its floor (the figures themselves mean nothing
here)."""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

import pytest
from gpu_device import DEVICE
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert

TOOL = Path(__file__).resolve().parents[1] / "bench" / "offload.py"


def run_tool(argv: list[str], monkeypatch, capsys) -> str:
    """bench/offload.py run as a script with argv; its stdout (it must exit 0)."""
    monkeypatch.setattr(sys, "argv", ["offload.py", *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with warnings.catch_warnings(), pytest.raises(SystemExit) as done:
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's masked divisions
        runpy.run_path(str(TOOL), run_name="__main__")
    assert done.value.code == 0
    return capsys.readouterr().out


def test_the_matrix_runs_and_prints_every_row(cc, tmp_path, capsys, monkeypatch):
    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", tie_word_embeddings=True)
    gguf = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    argv = [str(gguf), "--device", DEVICE, "-t", "1", "-p", "4", "-n", "2", "-r", "1",
            "--fractions", "0,0.5", "--misses", "cpu,stage,auto", "--sparsity", "0,0.5",
            "--ceiling-gib", "0.01"]  # fmt: skip
    out = run_tool(argv, monkeypatch, capsys)
    assert "ceilings (GB/s): DRAM read " in out and "costs: Costs(" in out
    table = [line for line in out.splitlines() if line.startswith("| ")][1:]  # past the head
    rows = [line.split(" | ") for line in table]
    got = {(r[1], r[2], r[3], r[4]) for r in rows}
    # budget 0: no slots for cpu, 2 x top-k transit slots for the others; 0.5: 8 of 16
    want = {(slots, misses, s, test) for slots, misses in
            [("0", "cpu"), ("4", "stage"), ("4", "auto"), ("8", "cpu"), ("8", "stage"),
             ("8", "auto")] for s in ("0", "0.5") for test in ("pp4", "tg2")}  # fmt: skip
    assert got == want and len(rows) == len(want)
    cpu_only = [r for r in rows if r[1] == "0"]
    assert all(r[5] == "plain" for r in rows)
    assert all(float(r[9]) == 0.0 and float(r[8]) > 0 for r in cpu_only)  # nothing staged
    assert (gguf.parent / (gguf.name + ".sparsity.json")).exists()  # calibrated for 0.5


def test_big_little_rows_and_their_combination(cc, tmp_path, capsys, monkeypatch):
    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", tie_word_embeddings=True)
    gguf = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    argv = [str(gguf), "--device", DEVICE, "-t", "1", "-p", "0", "-n", "3", "-r", "1",
            "--fractions", "0.5", "--misses", "auto", "--sparsity", "0,0.5", "--ceiling-gib",
            "0.01", "--big-little", "--fallback-ratio", "0.21,0.65"]  # fmt: skip
    out = run_tool(argv, monkeypatch, capsys)
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")][1:]
    modes = ["plain", "little", "lossy", "verify", "verify-resident"]
    assert [r[5] for r in rows] == modes * 2  # sparsity 0, then 0.5
    kept = [line for line in out.splitlines() if "drafts kept per round" in line]
    assert [line.split(":")[0].strip() for line in kept] == ["verify", "verify-resident"] * 2
    dense, sparse = [line for line in out.splitlines() if line.startswith("  big/little: ")]
    for line in (dense, sparse):
        assert "x at r = 0.21, " in line and "x at r = 0.65 (combined)" in line
    # sparse rows are also set against the dense plain step (big/little and sparsity together)
    assert "against the dense plain step" not in dense
    assert "against the dense plain step" in sparse and sparse.endswith("x at r = 0.65")


def test_a_model_whose_first_layer_is_dense(cc, tmp_path, capsys, monkeypatch):
    """deepseek2 (its first layer a dense FFN, latent attention): the matrix runs."""
    hf = make_tiny_hf_model("deepseek2", tmp_path / "hf", num_experts_per_tok=2)
    gguf = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    argv = [str(gguf), "--device", DEVICE, "-t", "1", "-p", "4", "-n", "2", "-r", "1",
            "--fractions", "0.5", "--misses", "auto", "--sparsity", "0",
            "--ceiling-gib", "0.01"]  # fmt: skip
    out = run_tool(argv, monkeypatch, capsys)
    assert "16 routed experts of " in out  # layers 1 and 2, 8 experts each
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 50.0% ")]
    assert {(r[1], r[2], r[4]) for r in rows} == {("8", "auto", "pp4"), ("8", "auto", "tg2")}


def test_n_direct_values_are_timed_against_each_other(cc, tmp_path, capsys, monkeypatch):
    """--n-direct X,Y: a row per value and sparsity, each labelled with its split; 0 leaves
    every miss to the CPU, k or more gives every miss to the GPU's in-place read."""
    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", tie_word_embeddings=True)
    gguf = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    argv = [str(gguf), "--device", DEVICE, "-t", "1", "-p", "0", "-n", "2", "-r", "1",
            "--fractions", "0", "--misses", "direct", "--n-direct", "0,auto,8",
            "--sparsity", "0", "--ceiling-gib", "0.01"]  # fmt: skip
    out = run_tool(argv, monkeypatch, capsys)
    table = [line for line in out.splitlines() if line.startswith("| ")][1:]
    rows = {r[2]: r for r in (line.split(" | ") for line in table)}
    assert list(rows) == ["direct 0", "direct", "direct 8"]
    cpu_mb, direct_mb = 8, 9  # columns: CPU MB/tok, staged (here: read in place) MB/tok
    assert float(rows["direct 0"][direct_mb]) == 0 and float(rows["direct 0"][cpu_mb]) > 0
    assert float(rows["direct 8"][cpu_mb]) == 0 and float(rows["direct 8"][direct_mb]) > 0
    assert 0 < float(rows["direct"][direct_mb]) < float(rows["direct 8"][direct_mb])
