"""`pyruntime serve`: one model over OpenAI's HTTP API (pyruntime.serve)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.cli.common import load_model, model_or_demo


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's HTTP API (chat and text completions)",
        description="Serve one model over HTTP as OpenAI's API does: POST /v1/chat/completions "
        'and /v1/completions (streamed with "stream": true), GET /v1/models and /health. '
        "Sampling parameters are those of the request, with llama.cpp's names and defaults "
        "(temperature, top_p, top_k, min_p, repeat_penalty, seed, stop, max_tokens). Requests "
        "are answered one at a time, in arrival order; a client that disconnects cancels its "
        'request. Needs the server extra: pip install "pyruntime[server]".',
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    options.add_arguments(p, "serve")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pyruntime.serve import open_listener, run_server

    path = model_or_demo(args.model)
    host, port = options.value("host", args.host), options.value("port", args.port)
    options.check("port", port, flag=True)
    sock = open_listener(host, port)  # before the load: a taken port is an error at once
    try:
        model = load_model(path, args, n_ctx=args.n_ctx)
    except BaseException:
        sock.close()
        raise
    print(
        f"pyruntime serve: {Path(path).name} on {model.device}, context {model.n_ctx} tokens, "
        f"OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    run_server(model, Path(path).name, sock)
    return 0
