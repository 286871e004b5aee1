"""The check every architecture's calibrate-and-sparsity test runs: `pyruntime calibrate` on one
text (docs/gguf-layout.md), then --sparsity on another (README.md) through the C core."""

from __future__ import annotations

from pathlib import Path

from pyruntime.converter import convert

REPO = Path(__file__).resolve().parents[1]


def check_calibrated_sparsity(hf_dir: Path, tmp_path: Path, targets: tuple[float, ...],
                              every_layer_sparse: bool = True) -> None:  # fmt: skip
    """Each target's thresholds drop that fraction of routed neurons within 3 points, in a
    512-token prompt and token by token over 256 tokens, and change the logits. On the C core
    (device="cpu"), also where a GPU is present (its switch may pick dense there);
    every_layer_sparse: the C decode step takes every layer sparse, even where dense steps
    measured faster (cpu/sparse_switch)."""
    from pyruntime.api import Model
    from pyruntime.cli import main

    path = convert(hf_dir, tmp_path / "m.gguf", "q8_0", progress=False)
    assert main(["calibrate", str(path), "-f", str(REPO / "docs" / "gguf-layout.md")]) == 0
    dense = Model(path, device="cpu")
    ids = dense.tokenize((REPO / "README.md").read_text())[:512]
    dense_logits = dense.logits(ids)
    for target in targets:
        model = Model(path, sparsity=target, device="cpu")
        logits = model.logits(ids)
        assert abs(model.achieved_sparsity - target) <= 0.03, (target, model.achieved_sparsity)
        assert (logits != dense_logits).any()
        step = Model(path, sparsity=target, device="cpu").net
        if every_layer_sparse:
            step.sparse_decode, step.sparse_layers = True, None
        cache = step.new_cache(256)
        for token in ids[:256]:
            step.forward([token], cache)
        assert abs(step.stats.sparsity - target) <= 0.03, (target, step.stats.sparsity)
