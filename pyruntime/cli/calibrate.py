"""`pyruntime calibrate`: activation sparsity thresholds of a model, measured over a text."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.cli.common import (
    check_output,
    check_window,
    load_model,
    progress_printer,
    read_text,
    window_flag,
)
from pyruntime.errors import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure activation sparsity thresholds for --sparsity",
        description="Run the model over a text, record |act(gate)| of every routed expert "
        "neuron per layer, and store the thresholds that skip 5%, 10%, ... 95% of them in "
        "MODEL.sparsity.json beside the model, or in --out FILE (the model file is not "
        "changed).",
    )
    p.add_argument("model", help="GGUF file")
    p.add_argument(
        "-f",
        "--file",
        type=Path,
        required=True,
        help="calibration text (UTF-8; - reads standard input)",
    )
    window_flag(p)
    p.add_argument(
        "--max-tokens", type=int, default=32768, help="use at most this many tokens (32768)"
    )
    p.add_argument(
        "-o", "--out", type=Path, default=None, metavar="FILE",
        help="write the table here (default: MODEL.sparsity.json beside the model; use a table "
        "written elsewhere with --sparsity-table FILE)",
    )  # fmt: skip
    options.add_arguments(p, "calibrate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pyruntime.experts.sparsity import calibrate, sidecar_path

    check_window(args.ctx)
    if not 1 <= args.max_tokens < options.C_INT:
        raise UsageError(f"--max-tokens must be in [1, 2^31), got {args.max_tokens}")
    text = read_text(args.file)
    out = args.out if args.out is not None else sidecar_path(Path(args.model))
    if args.out is not None or Path(args.model).is_file():  # (a missing model: its own error)
        check_output(out)  # before the run, not after it
    model = load_model(args.model, args, n_ctx=args.ctx)
    ctx = model.n_ctx  # -c 0: the model's trained context
    ids = model.tokenize(text, add_special=False)[: args.max_tokens]
    print(f"calibrate: {len(ids)} tokens of {args.file}, windows of {ctx}", file=sys.stderr)

    progress = progress_printer(sys.stderr)
    size = model.path.stat().st_size  # the user's file (a llama.cpp one runs from a copy)
    table = calibrate(model.net, ids, ctx, str(args.file), size, progress=progress)
    try:
        table.save(out)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write the table ({exc.strerror or exc})") from None
    shown = [0.5, 0.7, 0.9]
    print("layer  " + "  ".join(f"t@{s:.2f}" for s in shown))
    for layer, row in enumerate(table.thresholds):
        vals = [row[table.targets.index(s)] for s in shown]
        print(f"{layer:>5}  " + "  ".join(f"{v:8.5f}" for v in vals))
    hint = "" if args.out is None else f" (use it with --sparsity-table {out})"
    print(f"wrote {out}{hint}", file=sys.stderr)
    return 0
