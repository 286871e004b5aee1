"""The parser of every command and the one place their errors become an exit status."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence

from pyruntime import __version__, options
from pyruntime.cli import bench, calibrate, chat, generate, info, perplexity, repack, serve
from pyruntime.cli.common import quiet_exit
from pyruntime.cli.parsing import Parser
from pyruntime.errors import PyruntimeError
from pyruntime.output_files import Terminated

# In the order `pyruntime --help` lists them.
COMMANDS = (chat, generate, perplexity, bench, calibrate, repack, serve, info)


def build_parser() -> Parser:
    parser = Parser(
        prog="pyruntime",
        description="Run Mixture-of-Experts language models from GGUF files.",
    )
    parser.add_argument("--version", action="version", version=f"pyruntime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    warnings.showwarning = _show_warning
    try:
        options.check_args(args)
        return args.func(args)
    except PyruntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print("error: out of memory (a smaller context, model or input may fit)", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        if not _gpu_out_of_memory(exc):
            raise
        print(f"error: the GPU ran out of memory ({str(exc).splitlines()[0]}): lower --gpu-mem "
              "or --ctx-size, or use --device cpu", file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Terminated:
        return 143
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit-time flush quiet.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        quiet_exit()  # a Ctrl-C during the interpreter's teardown: no traceback


def _gpu_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error from torch (imported by then, if it was raised)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one `warning: ` line on stderr (no file, line or source)."""
    print(f"warning: {message}", file=sys.stderr)
