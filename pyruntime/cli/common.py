"""What the commands share: loading the model from the options, the flags several commands take,
and reading the user's text and output paths into one-line errors."""

from __future__ import annotations

import argparse
import atexit
import json
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.errors import PyruntimeWarning, UsageError
from pyruntime.output_files import Terminated, check_writable

# The pyruntime.Model keywords the CLI passes from its options (pyruntime.options).
RUNTIME = ("threads", "ubatch", "device", "sparsity", "sparsity_table", "gate_copy",
           "weights_copy", "kernel_tuning", "gpu_mem", "staging", "pin_experts", "cache_policy",
           "misses", "lookahead")  # fmt: skip
DECODING = (
    "experts_per_token", "little_experts", "big_little", "fallback_threshold", "fallback", "draft"
)  # fmt: skip


def load_model(path: str | Path, args: argparse.Namespace, n_ctx: int) -> Any:
    from pyruntime.api import Model

    runtime = options.from_args(args, RUNTIME + DECODING)
    if args.command == "calibrate":
        runtime["device"] = "cpu"  # the gate observer runs on the CPU path
    model = Model(path, n_ctx=n_ctx, seed=getattr(args, "seed", None), **runtime)
    if getattr(args, "stats", False):
        model.time_parts()
    return model


def model_or_demo(model: str | None) -> str | Path:
    """MODEL, or without one the built-in demo model's GGUF (converted on first use)."""
    if model is not None:
        return model
    from pyruntime.tools.demo import demo_model_path

    return demo_model_path()


def window_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=512, metavar="N",
        help="window size in tokens (0 = the model's trained context) (512)",
    )  # fmt: skip


def check_window(ctx: int) -> None:
    """-c of perplexity and calibrate: 0 (the trained context) or at least 2 tokens."""
    if not (ctx == 0 or 2 <= ctx < options.C_INT):
        raise UsageError(f"-c/--ctx-size must be 0 (the model's) or >= 2 tokens, got {ctx}")


def stats_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stats", action="store_true",
        help="print what the model did (sparsity, big/little fallbacks, ...) as JSON on stderr",
    )  # fmt: skip


def print_stats(model: Any, args: argparse.Namespace) -> None:
    if args.stats:
        print("stats: " + json.dumps(model.stats()), file=sys.stderr)


def sparsity_report(model: Any) -> str:
    """'' when dense; else the target and the measured fraction of skipped expert neurons, in
    all and per phase (prefill: forward passes of several tokens; decode: of one)."""
    if not model.sparsity:
        return ""
    phases = ", ".join(f"{p} {v:.3f}" for p, v in model.sparsity_by_phase().items())
    return (
        f" | expert sparsity: target {model.sparsity:.2f}, achieved {model.achieved_sparsity:.3f}"
        + (f" ({phases})" if phases else "")
        + _dense_decode_note(getattr(model, "net", None))
    )


def _dense_decode_note(net: Any) -> str:
    """Why decode skipped fewer neurons than asked, where the CPU executor's switch
    (pyruntime.cpu.sparse_switch) measured dense decode steps faster in some MoE layers or all."""
    layers = getattr(net, "sparse_layers", None)
    if not layers:
        return ""
    moe = [layers[i] for i in net.moe_layers()]
    if all(moe):
        return ""
    if not any(moe):
        return "; decode dense: measured faster than sparse on this machine"
    return (
        f"; decode sparse in {sum(moe)} of {len(moe)} MoE layers (the rest measured faster dense)"
    )


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = options.from_args(
        args, ("max_tokens", "top_k", "top_p", "min_p", "repeat_penalty", "stop")
    )
    kwargs["stop"] = [valid_text(s, "--stop") for s in kwargs["stop"] or ()]
    if kwargs["max_tokens"] == -1:
        kwargs["max_tokens"] = None  # no limit but a stop or the context
    return kwargs


_WARNED_UNDECODABLE: set[str] = set()


def valid_text(text: str, what: str) -> str:
    """`text` with bytes that were not UTF-8 (read as lone surrogates: argv, a reconfigured
    stdin) replaced by U+FFFD, with one warning saying so; the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        fixed = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that were not bytes: replace them too
        fixed = text.encode("utf-8", "replace").decode("utf-8")
    if what not in _WARNED_UNDECODABLE:  # once per source, not per line of a session
        _WARNED_UNDECODABLE.add(what)
        warnings.warn(
            f"{what} had bytes that are not UTF-8; they were replaced by U+FFFD",
            PyruntimeWarning,
            stacklevel=2,
        )
    return fixed


def check_output(path: Path) -> None:
    """UsageError unless a file can be written at `path` (its folder exists and is writable)."""
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; give -o a file name")
    if not path.parent.is_dir():
        raise UsageError(f"{path}: folder {path.parent} does not exist; choose another -o FILE")
    try:
        check_writable(path.parent)
    except OSError as exc:
        raise UsageError(
            f"{path}: cannot write in {path.parent} ({exc.strerror or exc}); choose another "
            "place with -o FILE"
        ) from None


def read_text(path: Path) -> str:
    """The UTF-8 text of `path` (`-`: standard input, to its end)."""
    stdin = str(path) == "-"
    name = "standard input" if stdin else str(path)
    try:
        if stdin:
            return sys.stdin.buffer.read().decode("utf-8")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{name}: is a directory, expected a text file") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"{name}: cannot read ({exc.strerror})") from None


PROGRESS_LINES = 10  # off a terminal: about this many progress lines, however many windows


def progress_printer(out: Any) -> Callable[[int, int, str], None]:
    """show(done, total, note) prints "[done/total]note": on a terminal one line rewritten in
    place, else a line every total / PROGRESS_LINES and at the end (a log, not a line a step)."""
    tty = out.isatty()

    def show(done: int, total: int, note: str = "") -> None:
        line = f"[{done}/{total}]{note}"
        if tty:
            print(f"\r{line}", end="\n" if done == total else "", file=out, flush=True)
        elif done % max(1, total // PROGRESS_LINES) == 0 or done == total:
            print(line, file=out, flush=True)

    return show


def no_output_written(exc: BaseException, prefix: str = "") -> int:
    """A command whose output goes into place only when complete, stopped by Ctrl-C
    (KeyboardInterrupt) or SIGTERM (Terminated): its one line on stderr, and its exit status."""
    word, status = ("terminated", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
    print(f"{prefix}{word}; no output written", file=sys.stderr)
    return status


def quiet_exit() -> None:
    """Ctrl-C is ignored once the process exits: the command is done (its output renamed into
    place), and a KeyboardInterrupt in the interpreter's teardown (torch's exit callbacks) would
    print `Exception ignored in atexit callback` and a traceback after a run that succeeded. Exit
    callbacks run last first: call this when the command has returned, after every import that
    registers one (called again, it moves to the end). SIGINT already ignored, or a host
    application's handler, is left alone; nothing changes before the exit."""
    atexit.unregister(_ignore_sigint)
    atexit.register(_ignore_sigint)


def _ignore_sigint() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # SIG_IGN, not a Python handler that does nothing: the interpreter puts a Python handler
        # back to SIG_DFL when it finalizes, and torch's C++ teardown runs after that (a Ctrl-C
        # there would end a run that succeeded with status 130).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
