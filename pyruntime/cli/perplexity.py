"""`pyruntime perplexity`: perplexity of a text file, in windows of -c tokens."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.cli.common import (
    check_window,
    load_model,
    progress_printer,
    read_text,
    sparsity_report,
    window_flag,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "perplexity",
        help="perplexity of a text file",
        description="Tokenize the whole file (BOS only if the model adds one), cut it into "
        "consecutive non-overlapping windows of -c/--ctx-size tokens, evaluate each window with "
        "a fresh cache and score every token after the first of each window. The tail after the "
        "last full window is scored as a shorter window when it has at least 2 tokens, and "
        "dropped otherwise. Prints `ppl = X` as the last line of stdout.",
    )
    p.add_argument("model", help="GGUF file")
    p.add_argument(
        "-f", "--file", type=Path, required=True, help="text file (UTF-8; - reads standard input)"
    )
    window_flag(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"ppl", "nll", "tokens_scored", "windows", "ctx", "sparsity_target", '
        '"sparsity_achieved"; with --sparsity also "sparsity_achieved_prefill"} as JSON instead',
    )
    options.add_arguments(p, "perplexity")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pyruntime.tools.perplexity import perplexity

    check_window(args.ctx)
    text = read_text(args.file)
    model = load_model(args.model, args, n_ctx=args.ctx)
    ctx = model.n_ctx  # -c 0: the model's trained context
    ids = model.tokenize(text, add_special=True)
    print(f"perplexity: {len(ids)} tokens, windows of {ctx}", file=sys.stderr)

    show = progress_printer(sys.stderr)
    result = perplexity(
        model, ids, ctx, progress=lambda i, n, ppl: show(i + 1, n, f" running ppl = {ppl:.4f}")
    )
    if model.sparsity:
        print(sparsity_report(model).lstrip(" |"), file=sys.stderr)
    if args.json:
        out = result.as_dict()
        out["sparsity_target"] = model.sparsity
        out["sparsity_achieved"] = model.achieved_sparsity
        if model.sparsity:
            for phase, v in model.sparsity_by_phase().items():
                out[f"sparsity_achieved_{phase}"] = v
        print(json.dumps(out))
    else:
        print(f"tokens scored = {result.tokens_scored}, windows = {result.windows}")
        print(f"ppl = {result.ppl:.4f}")
    return 0
