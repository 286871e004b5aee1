"""The `pyruntime` command: chat, generate, perplexity, bench, calibrate, repack, serve, info.

One module per command (its parser and its run), what they share in common.py, the parser of
them all and the exit statuses in entry.py; `main` is the `pyruntime` console script and
`python -m pyruntime`.

Output discipline: stdout carries only the product (answers, generated text, `ppl = X`, info),
stderr the diagnostics (timings, progress, banners), so every command can be piped.
Errors a user can cause (PyruntimeError) print `error: <message>` and exit 1 without a traceback;
Ctrl-C exits 130, except during a chat answer, where it stops only that answer.
Heavy imports (torch) happen inside the commands so `--help` and `--version` stay instant.
"""

from pyruntime.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
