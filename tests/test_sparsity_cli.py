"""`pyruntime calibrate` and `--sparsity` end to end on the demo model (in-process CLI calls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyruntime.api import Model
from pyruntime.cli import main
from pyruntime.errors import UsageError
from pyruntime.experts.sparsity import sidecar_path
from pyruntime.tools.demo import demo_model_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return demo_model_path(cache=tmp_path_factory.mktemp("cache"), quiet=True)


def test_sparsity_needs_calibration_then_hits_target(demo, capsys):
    eval_text = REPO / "README.md"
    calib_text = REPO / "docs" / "gguf-layout.md"  # a different text than the one evaluated

    assert main(["perplexity", str(demo), "-f", str(eval_text), "--sparsity", "0.5"]) == 1
    assert "run `pyruntime calibrate" in capsys.readouterr().err

    assert main(["calibrate", str(demo), "-f", str(calib_text)]) == 0
    assert sidecar_path(demo).is_file()

    dense = Model(demo)
    ids = dense.tokenize(eval_text.read_text())[:512]
    dense_logits = dense.logits(ids)
    assert dense.achieved_sparsity == 0.0
    for target in (0.3, 0.5, 0.7, 0.9):
        model = Model(demo, sparsity=target)
        sparse_logits = model.logits(ids)
        # Thresholds measured on one text, applied to another (512 tokens x 4 layers x 4
        # experts x 96 neurons = 786k decisions): the achieved fraction lands within a few
        # points of the target; 0.05 is the bound for so small a sample.
        assert abs(model.achieved_sparsity - target) <= 0.05, (target, model.achieved_sparsity)
        assert sparse_logits.shape == dense_logits.shape
        assert (sparse_logits != dense_logits).any()

    # the gate rows apart for the CPU's sparse decode steps: kept for the layers decoded sparse
    copied = Model(demo, sparsity=0.9, gate_copy="on").net
    sparse = copied.sparse_layers
    assert sorted(copied._gate_copies) == [i for i, on in enumerate(sparse) if on]
    assert Model(demo, sparsity=0.9, gate_copy="off").net.gate_copy_bytes == 0
    with pytest.raises(UsageError, match="gate_copy must be one of"):
        Model(demo, gate_copy="always")

    with pytest.raises(UsageError, match=r"\[0, 1\)"):
        Model(demo, sparsity=1.0)
    with pytest.raises(UsageError, match="highest calibrated"):
        Model(demo, sparsity=0.97)


def test_calibration_text_too_short(demo, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short to measure anything.")
    assert main(["calibrate", str(demo), "-f", str(short)]) == 1
    assert "too short" in capsys.readouterr().err
