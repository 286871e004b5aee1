"""`pyruntime chat`: an interactive chat, or one answer per input line when stdin is piped."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.cli.common import (
    load_model,
    model_or_demo,
    print_stats,
    sampling_kwargs,
    sparsity_report,
    stats_flag,
    valid_text,
)
from pyruntime.errors import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "chat",
        help="interactive chat (the built-in demo model without MODEL)",
        description="Chat with a model. Commands: /reset clears the history, /exit quits "
        "(or Ctrl-D), /help lists them. Ctrl-C stops the current answer. When stdin is not a "
        "terminal, each input line is one user message and only the answers are printed.",
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    p.add_argument("--system", default=None, help="system prompt")
    stats_flag(p)
    options.add_arguments(p, "chat")
    p.set_defaults(func=run)


COMMANDS_HELP = "/reset clears the history, /exit quits, Ctrl-C stops an answer, /help this."


def run(args: argparse.Namespace) -> int:
    path = model_or_demo(args.model)
    model = load_model(path, args, n_ctx=args.n_ctx)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes reach valid_text, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    system_prompt = valid_text(args.system, "--system") if args.system else None
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    history: list[dict[str, str]] = list(system)
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        name = Path(path).name if args.model is not None else "the built-in demo model"
        print(f"pyruntime chat with {name}: {COMMANDS_HELP}", file=sys.stderr)
    kwargs = sampling_kwargs(args)
    while True:
        line = _read_user_line(interactive)
        if line is None:
            if model.sparsity:
                print(sparsity_report(model).lstrip(" |"), file=sys.stderr)
            print_stats(model, args)
            return 0
        line = valid_text(line, "the input").strip()
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history = list(system)
            model.reset()
            if interactive:
                print("(history cleared)", file=sys.stderr)
            continue
        if line in ("/help", "/?"):
            print(COMMANDS_HELP, file=sys.stderr)
            continue
        if interactive and re.fullmatch(r"/[A-Za-z]+", line):  # a mistyped command, not a message
            print(f"unknown command {line}: /help lists them", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = _stream_answer(model, history, args, kwargs)
        except UsageError as exc:
            if not interactive:
                raise
            # e.g. the history outgrew the context: keep the session, let the user /reset.
            history.pop()
            print(f"error: {exc} (type /reset to start over)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})


def _read_user_line(interactive: bool) -> str | None:
    """The next user line, or None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line if line else None
    try:
        return input("> ")
    except EOFError:
        print(file=sys.stderr)
        return None


def _stream_answer(
    model: Any, history: list[dict[str, str]], args: argparse.Namespace, kwargs: dict[str, Any]
) -> str:
    """Print the answer as it streams; Ctrl-C ends it early. Returns the text printed."""
    pieces: list[str] = []
    stream = model.create_chat_completion(
        history, stream=True, temperature=args.temp, seed=None, **kwargs
    )
    try:
        for chunk in stream:
            piece = chunk["choices"][0]["delta"].get("content", "")
            if piece:
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        print("\n(answer interrupted)", file=sys.stderr, end="")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)
