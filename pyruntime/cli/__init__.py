"""The `pyruntime` command: chat, generate, perplexity, bench, calibrate, repack, serve, info.

One module per command (its parser and its run), what they share in common.py, the parser of
them all and the exit statuses in entry.py; `main` is the `pyruntime` console script and
`python -m pyruntime`. convert_hf.py is the command line of convert_hf_to_gguf.py (the converter's
script, not a `pyruntime` command).

Output discipline: stdout carries only the product (answers, generated text, `ppl = X`, info),
stderr the diagnostics (timings, progress, banners), so every command can be piped.
Errors a user can cause (PyruntimeError) print `error: <message>` and exit 1 without a traceback;
Ctrl-C exits 130, except during a chat answer, where it stops only that answer; in `repack` and
the converter it prints one line, "interrupted; no output written" (SIGTERM: "terminated", 143),
whatever error a C extension turned it into (pyruntime.output_files.signals_raise); once a command
has returned, the interpreter's teardown ignores it (common.quiet_exit).
Heavy imports (torch) happen inside the commands so `--help` and `--version` stay instant.
"""

from pyruntime.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
