"""The OpenAI-compatible HTTP API over one Model (Starlette; run by uvicorn, __init__.py).

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events when
`stream` is true, ending with `data: [DONE]`), GET /v1/models, GET /health (with the request
counts). Every error is OpenAI's error object: 400 for a malformed or invalid request (bad JSON,
a field of the wrong type, a prompt that does not fit the context), 404 and 405 for unknown
routes and methods, 413 for a body over MAX_BODY_BYTES, 500 for a bug; the server goes on
serving after any of them. A request waits its turn in the worker's FIFO queue; its client
disconnecting cancels it (worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pyruntime.errors import PyruntimeError
from pyruntime.serve.protocol import (
    ApiError,
    Completion,
    Request,
    Responses,
    parse_chat,
    parse_completion,
)
from pyruntime.serve.worker import Job, Worker

MAX_BODY_BYTES = 16 << 20
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting request checks that its client is there


class Server:
    """The app's state: the Model, its name, the worker."""

    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name
        self.worker = Worker()

    # ---- requests -> jobs ---------------------------------------------------------------------

    def prompt_ids(self, req: Request) -> list[int]:
        """The prompt's token ids (chat: rendered with the model's template); 400 when it does
        not fit the context."""
        model = self.model
        try:
            if req.kind == "chat":
                ids = self._tokenize(model.apply_chat_template(req.messages), req)
            elif isinstance(req.prompt, str):
                ids = self._tokenize(req.prompt, req)
            else:
                ids = list(req.prompt)
        except PyruntimeError as exc:  # a template that refuses the messages, say
            raise ApiError(str(exc)) from None
        n_vocab = model.config.n_vocab
        if any(not 0 <= i < n_vocab for i in ids):
            raise ApiError(f"'prompt' holds a token id outside [0, {n_vocab})", param="prompt")
        if not ids:
            raise ApiError("the prompt is empty", param="prompt")
        if len(ids) >= model.n_ctx:
            raise _too_long(f"{len(ids)} tokens", model.n_ctx, req)
        return ids

    def _tokenize(self, text: str, req: Request) -> list[int]:
        """text's ids; a text too long for the context by its length alone is refused before
        it is tokenized (megabytes of text take the tokenizer seconds, and the queue waits)."""
        n_ctx, per_token = self.model.n_ctx, self.model.tokenizer.max_chars_per_token
        if len(text) >= n_ctx * per_token:
            raise _too_long(f"at least {len(text) // per_token} tokens", n_ctx, req)
        return self.model.tokenize(text, add_special=True)

    def job(self, req: Request, ids: list[int]) -> Job:
        def start():
            return self.model.generate(ids, max_tokens=req.max_tokens, stop=req.stop,
                                       ignore_eos=req.ignore_eos, **req.sampling)  # fmt: skip

        return Job(start, len(ids), asyncio.get_running_loop())

    # ---- endpoints ----------------------------------------------------------------------------

    async def chat(self, http: HttpRequest) -> Response:
        return await self._complete(http, parse_chat)

    async def completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, parse_completion)

    async def _complete(self, http: HttpRequest, parse) -> Response:
        req = parse(await _body(http))
        ids = await asyncio.to_thread(self.prompt_ids, req)
        job = self.job(req, ids)
        responses = Responses(req.kind, self.name)
        self.worker.submit(job)
        if req.stream:
            return StreamingResponse(self._events(http, job, responses, req),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            text = []
            async for kind, value in _events_of(http, job):
                if kind == "piece":
                    text.append(value)
                elif kind == "error":
                    raise _as_api_error(value)
                else:
                    return JSONResponse(responses.whole(value))
        finally:
            job.cancel()  # no-op when done; the client left otherwise
        return Response(status_code=499)  # the client went away: nobody reads this

    async def _events(self, http: HttpRequest, job: Job, responses: Responses,
                      req: Request) -> AsyncIterator[str]:  # fmt: skip
        try:
            if req.kind == "chat":
                yield _sse(responses.chunk(None, first=True))  # the role, as OpenAI sends it
            async for kind, value in _events_of(http, job):
                if kind == "piece":
                    yield _sse(responses.chunk(value))
                elif kind == "error":
                    yield _sse(_as_api_error(value).body())
                    break
                else:
                    done: Completion = value
                    yield _sse(responses.chunk(None, done.finish_reason))
                    if req.include_usage:
                        yield _sse(responses.usage_chunk(done))
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away (or all was sent: then a no-op)

    async def models(self, http: HttpRequest) -> Response:
        cfg = self.model.config
        meta = {"n_ctx": self.model.n_ctx, "n_ctx_train": cfg.context_length,
                "n_vocab": cfg.n_vocab, "architecture": cfg.arch}  # fmt: skip
        created = int(self.model.path.stat().st_mtime)
        data = [{"id": self.name, "object": "model", "created": created, "owned_by": "pyruntime",
                 "meta": meta}]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def health(self, http: HttpRequest) -> Response:
        c = self.worker.counts
        return JSONResponse({"status": "ok", "requests": {
            "queued": c.queued, "running": c.running, "completed": c.completed,
            "cancelled": c.cancelled, "failed": c.failed,
        }})  # fmt: skip


def _too_long(size: str, n_ctx: int, req: Request) -> ApiError:
    return ApiError(
        f"the prompt is {size}, and the context holds {n_ctx} (the server's --ctx-size): "
        "shorten it",
        param="messages" if req.kind == "chat" else "prompt",
        code="context_length_exceeded",
    )


async def _events_of(http: HttpRequest, job: Job) -> AsyncIterator[tuple[str, Any]]:
    """The job's events until done or error, checking every DISCONNECT_POLL_SECONDS that the
    client is still there, whether or not events came meanwhile (a gone client cancels the job
    and ends the iteration). A request that is not streamed writes nothing until its end, so
    only this check sees its client leave while tokens flow."""
    loop = asyncio.get_running_loop()
    checked = loop.time()
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            event = None
        if event is None or loop.time() - checked >= DISCONNECT_POLL_SECONDS:
            checked = loop.time()
            if await http.is_disconnected():
                job.cancel()
                return
        if event is None:
            continue
        yield event
        if event[0] != "piece":
            return


async def _body(http: HttpRequest) -> Any:
    """The request's JSON body: 413 past MAX_BODY_BYTES, 400 when it is not JSON."""
    size = http.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
    chunks, total = [], 0
    async for chunk in http.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})") from None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PyruntimeError):
        return ApiError(str(exc))
    return ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                    kind="server_error")  # fmt: skip


async def _api_error(http: HttpRequest, exc: Exception) -> Response:
    return JSONResponse(_as_api_error(exc).body(), status_code=_as_api_error(exc).status)


async def _http_error(http: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = ApiError(f"{http.method} {http.url.path}: {exc.detail}", exc.status_code, kind=kind)
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _disconnected(http: HttpRequest, exc: Exception) -> Response:
    return Response(status_code=499)


def _lifespan(server: Server):
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        server.worker.stop()

    return lifespan


def create_app(model: Any, name: str) -> Starlette:
    """The ASGI app serving `model` (a pyruntime.Model) under the model id `name`."""
    server = Server(model, name)
    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            ClientDisconnect: _disconnected,
            Exception: _api_error,
        },
        lifespan=_lifespan(server),
    )
    app.state.server = server
    return app
