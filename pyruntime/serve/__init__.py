"""`pyruntime serve`: an OpenAI-compatible HTTP server over one model (app.py), run by uvicorn.

    pyruntime serve model.gguf --port 8080
    curl localhost:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Needs the `server` extra (`pip install "pyruntime[server]"`: starlette and uvicorn).
"""

from __future__ import annotations

import socket
from typing import Any

from pyruntime.errors import UsageError


def run_server(model: Any, name: str, host: str, port: int) -> None:
    """Serve `model` (a pyruntime.Model) until interrupted (Ctrl-C, SIGTERM)."""
    try:
        import uvicorn

        from pyruntime.serve.app import create_app
    except ImportError as exc:
        raise UsageError(
            f"`pyruntime serve` needs the server extra ({exc.name} is not installed): "
            'pip install "pyruntime[server]"'
        ) from None
    try:  # bound here, so that a taken port or an unknown host is one error line
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise UsageError(f"cannot serve on {host}:{port} ({exc.strerror or exc})") from None
    config = uvicorn.Config(create_app(model, name), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)  # fmt: skip
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
