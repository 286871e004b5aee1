"""`pyruntime serve`: an OpenAI-compatible HTTP server over one model (app.py), run by uvicorn.

    pyruntime serve model.gguf --port 8080
    curl localhost:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Needs the `server` extra (`pip install "pyruntime[server]"`: starlette and uvicorn).
"""

from __future__ import annotations

import socket
from typing import Any

from pyruntime.errors import UsageError


def _server_modules() -> tuple[Any, Any]:
    """(uvicorn, app.create_app); a UsageError naming the missing package without the extra."""
    try:
        import uvicorn

        from pyruntime.serve.app import create_app
    except ImportError as exc:
        raise UsageError(
            f"`pyruntime serve` needs the server extra ({exc.name} is not installed): "
            'pip install "pyruntime[server]"'
        ) from None
    return uvicorn, create_app


def open_listener(host: str, port: int) -> socket.socket:
    """The listening socket on host:port, bound before the model is loaded, so that a missing
    server extra, a taken port or an unknown host is one error line at once, not after the
    load. The caller hands it to run_server (or closes it)."""
    _server_modules()
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise UsageError(f"cannot serve on {host}:{port} ({exc.strerror or exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot serve on {host}:{port} ({exc.strerror or exc})") from None
    return sock


def run_server(model: Any, name: str, sock: socket.socket) -> None:
    """Serve `model` (a pyruntime.Model) on `sock` (open_listener's) until interrupted (Ctrl-C,
    SIGTERM); the socket is closed on return."""
    uvicorn, create_app = _server_modules()
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(model, name), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)  # fmt: skip
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
