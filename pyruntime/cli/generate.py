"""`pyruntime generate`: continue a prompt; the text alone goes to stdout."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.cli.common import (
    load_model,
    print_stats,
    read_text,
    sampling_kwargs,
    sparsity_report,
    stats_flag,
    valid_text,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt; the text alone goes to stdout",
        description="Continue a prompt. The generated text alone goes to stdout (streamed), "
        "timings to stderr.",
    )
    p.add_argument("model", help="GGUF file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument(
        "-f", "--file", type=Path, help="read the prompt from this file (- : standard input)"
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop on the model's end tokens"
    )
    stats_flag(p)
    options.add_arguments(p, "generate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prompt is not None:
        prompt = valid_text(args.prompt, "the prompt")
    else:
        prompt = read_text(args.file)
    model = load_model(args.model, args, n_ctx=args.n_ctx)
    kwargs = sampling_kwargs(args)
    stream = model.generate(
        prompt,
        temp=args.temp,
        repeat_last_n=args.repeat_last_n,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        **kwargs,
    )
    finish, code = None, 0
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # stop, and still say how far it got
        stream.close()
        finish, code = "interrupted", 130
    if sys.stdout.isatty() or code or _same_file(sys.stdout, sys.stderr):
        sys.stdout.write("\n")  # the finish line below on a line of its own
    sys.stdout.flush()
    print(
        f"finish: {finish or stream.finish_reason} | {stream.stats.summary()}"
        f"{sparsity_report(model)}",
        file=sys.stderr,
    )
    print_stats(model, args)
    return code


def _same_file(a: Any, b: Any) -> bool:
    """Whether two streams write to one file (`2>&1` into a pipe or a file)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
