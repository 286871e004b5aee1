"""Intra-expert activation sparsity: calibration of per-layer thresholds, and their use.

A routed expert computes h_j = act(g_j . x) * (u_j . x) for each neuron j. Most |act(g_j . x)| are
tiny; dropping neurons under a per-layer threshold skips their up and down rows. Calibration runs
the model over a text, records the distribution of |act(gate)| of every routed (token, expert,
neuron) per layer in a log-spaced histogram, and stores, for each target sparsity 0.05 ... 0.95,
the threshold that drops that fraction. The table lives in a sidecar JSON next to the GGUF
(`MODEL.gguf.sparsity.json`), so calibrating never rewrites the model file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pyruntime.errors import ModelFileError, UsageError
from pyruntime.experts.store import ExpertStore
from pyruntime.model.reference import expert_gate_act
from pyruntime.output_files import atomic_output

FORMAT = "pyruntime-sparsity/1"
TARGETS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 ... 0.95
MIN_TOKENS = 256  # fewer calibration tokens cannot place a 0.95 quantile per layer reliably

# Histogram of log10|a| over [LOG_LO, LOG_HI): 0.005-decade bins (1.2% relative threshold step).
LOG_LO, LOG_HI, N_BINS = -8.0, 3.0, 2200


def sidecar_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".sparsity.json")


class GateHistogram:
    """Per-layer histograms of |act(gate . x)| over routed (token, expert, neuron) triples."""

    def __init__(self, n_layer: int) -> None:
        self.counts = torch.zeros(n_layer, N_BINS + 2, dtype=torch.float64)  # + under/overflow

    def observe(
        self, layer: int, store: ExpertStore, x: torch.Tensor, ids: torch.Tensor, act: str
    ) -> None:
        """x: [T, n_embd]; ids: [T, K] routed experts. Adds T*K*n_ff values to layer's histogram."""
        for e in torch.unique(ids).tolist():
            tok = torch.nonzero((ids == e).any(dim=1), as_tuple=True)[0]
            a = expert_gate_act(store, e, x[tok], act).abs().reshape(-1)
            self.counts[layer] += _bin_counts(a)

    def thresholds(self, targets: Sequence[float]) -> list[list[float]]:
        """[n_layer][len(targets)]: smallest t with fraction(|a| < t) >= target, per layer."""
        out = []
        for row in self.counts:
            total = float(row.sum())
            cum = torch.cumsum(row, 0) / max(total, 1.0)
            out.append([_quantile_from_cdf(cum, s) if total else 0.0 for s in targets])
        return out

    def samples(self) -> list[int]:
        return [int(c) for c in self.counts.sum(dim=1)]


def _bin_counts(a: torch.Tensor) -> torch.Tensor:
    """Counts over N_BINS log bins plus underflow (index 0) and overflow (index N_BINS+1)."""
    la = torch.log10(a.double().clamp_min(1e-30))
    idx = ((la - LOG_LO) / (LOG_HI - LOG_LO) * N_BINS).floor().long() + 1
    idx = idx.clamp(0, N_BINS + 1)
    return torch.bincount(idx, minlength=N_BINS + 2).double()


def _edge(i: int) -> float:
    """Lower edge (value, not log) of histogram index i (1-based inner bins)."""
    return 10 ** (LOG_LO + (i - 1) * (LOG_HI - LOG_LO) / N_BINS)


def _quantile_from_cdf(cum: torch.Tensor, s: float) -> float:
    i = int(torch.searchsorted(cum, torch.tensor(s, dtype=cum.dtype)))  # first bin with cdf >= s
    if i == 0:
        return _edge(1)
    if i >= N_BINS + 1:
        return _edge(N_BINS + 1)
    lo_cdf = float(cum[i - 1])
    hi_cdf = float(cum[i])
    frac = 0.0 if hi_cdf == lo_cdf else (s - lo_cdf) / (hi_cdf - lo_cdf)
    lo, hi = math.log10(_edge(i)), math.log10(_edge(i + 1))
    return 10 ** (lo + frac * (hi - lo))  # log-linear inside the bin


@dataclass
class SparsityTable:
    """Thresholds[layer][k] that drop fraction TARGETS[k] of routed neurons of that layer."""

    targets: list[float]
    thresholds: list[list[float]]
    tokens: int
    source: str
    model_size: int  # bytes of the GGUF it was calibrated on (a cheap identity check)

    def for_sparsity(self, s: float) -> list[float] | None:
        """Per-layer thresholds for sparsity s (None = dense), interpolated between targets."""
        check_sparsity(s)
        if s == 0:
            return None
        if s > self.targets[-1]:
            raise UsageError(
                f"--sparsity {s} is above the highest calibrated target {self.targets[-1]}"
            )
        pts = [0.0, *self.targets]
        out = []
        for row in self.thresholds:
            vals = [0.0, *row]
            k = max(i for i, p in enumerate(pts) if p <= s)
            if k == len(pts) - 1:
                out.append(vals[k])  # s == the last target
                continue
            frac = (s - pts[k]) / (pts[k + 1] - pts[k])
            out.append(vals[k] + frac * (vals[k + 1] - vals[k]))
        return out

    def save(self, path: Path) -> None:
        """Write the table to `path` whole or not at all (pyruntime.output_files)."""
        data = {
            "format": FORMAT,
            "scope": "routed",
            "source": self.source,
            "tokens": self.tokens,
            "model_size": self.model_size,
            "targets": self.targets,
            "thresholds": self.thresholds,
        }
        with atomic_output(path) as tmp:
            tmp.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, model_path: Path, table_path: str | Path | None = None) -> SparsityTable:
        """The table of `model_path`: table_path, or the sidecar beside the model."""
        if table_path is not None:
            path = Path(table_path)
            if not path.is_file():
                raise UsageError(f"{path}: no such calibration table (--sparsity-table)")
        else:
            path = sidecar_path(model_path)
        if not path.exists():
            raise UsageError(
                f"{model_path} has no sparsity calibration ({path.name} not found): run "
                f"`pyruntime calibrate {model_path} -f TEXT` first"
            )
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            table = cls(
                targets=[float(t) for t in data["targets"]],
                thresholds=[[float(v) for v in row] for row in data["thresholds"]],
                tokens=int(data["tokens"]),
                source=str(data["source"]),
                model_size=int(data["model_size"]),
            )
        except OSError as exc:
            reason = exc.strerror or exc
            raise UsageError(f"{path}: cannot read the calibration table ({reason})") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFileError(f"{path}: bad sparsity calibration file ({exc})") from None
        if table.model_size != model_path.stat().st_size:
            raise ModelFileError(
                f"{path} was calibrated on another file ({table.model_size} bytes, this one "
                f"has {model_path.stat().st_size}): run `pyruntime calibrate {model_path} -f TEXT` "
                "again"
            )
        return table


def check_sparsity(s: float) -> None:
    if not (0.0 <= s < 1.0) or math.isnan(s):
        raise UsageError(f"--sparsity must be in [0, 1), got {s}")


def calibrate(
    net,
    token_ids: Sequence[int],
    ctx: int,
    source: str,
    model_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> SparsityTable:
    """Run `net` (the CPU executor, whose gate observer sees every routed expert's input) over
    token_ids in windows of ctx tokens and build the table."""
    if len(token_ids) < MIN_TOKENS:
        raise UsageError(
            f"calibration text is too short: {len(token_ids)} tokens, need at least {MIN_TOKENS} "
            "(use a longer text, e.g. a few pages of prose)"
        )
    hist = GateHistogram(net.config.n_layer)
    windows = [token_ids[i : i + ctx] for i in range(0, len(token_ids), ctx)]
    net.gate_observer = hist.observe
    try:
        for w, window in enumerate(windows):
            net.forward(window, net.new_cache(len(window)), last_only=True)
            if progress:
                progress(w + 1, len(windows))
    finally:
        net.gate_observer = None
    return SparsityTable(
        targets=list(TARGETS),
        thresholds=hist.thresholds(TARGETS),
        tokens=len(token_ids),
        source=source,
        model_size=model_size,
    )
