"""Command line of `python convert_hf_to_gguf.py MODEL [--outfile F] [--outtype TYPE] [--force]`.

Here rather than in pyruntime.converter, whose import loads torch (a second or two): the arguments
are parsed, and --help or a usage error answered, before that; and a Ctrl-C while it loads is an
interrupt like any other (one line, status 130)."""

from __future__ import annotations

import sys
from pathlib import Path

from pyruntime.cli.common import no_output_written, quiet_exit
from pyruntime.cli.parsing import Parser
from pyruntime.cli.repack import OUTTYPES  # the converter's (kept in sync by a test)
from pyruntime.errors import PyruntimeError
from pyruntime.output_files import Terminated, signals_raise


def build_parser() -> Parser:
    p = Parser(
        prog="convert_hf_to_gguf.py",
        description="Convert a Hugging Face MoE checkpoint to a pyruntime GGUF file.",
    )
    p.add_argument("model", help="local HF model folder, or a Hub repo id (org/name)")
    p.add_argument(
        "--outfile", type=Path, help="output path (default: <model-name>-<outtype>.gguf)"
    )
    p.add_argument(
        "--outtype", choices=list(OUTTYPES), default="f16", help="weight type (default f16)"
    )
    p.add_argument(
        "--force", action="store_true",
        help="overwrite an existing --outfile (never a file of the checkpoint itself)",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # signals_raise: an error a C extension turned the Ctrl-C into is the interrupt too
        with signals_raise():
            from pyruntime.converter import convert

            convert(
                args.model, args.outfile, args.outtype, progress=not args.quiet, force=args.force
            )
    except PyruntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as exc:
        return no_output_written(exc)
    finally:
        quiet_exit()
    return 0
