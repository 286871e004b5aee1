"""The OpenAI API's requests, checked, and its responses, built (for app.py).

A request body becomes a `Request`: the prompt (chat messages rendered with the model's chat
template, or a completion prompt as text or token ids) and the generation parameters, mapped as
llama.cpp's server maps them (tools/server/utils.hpp, params_from_json_cmpl): OpenAI's names
(`max_tokens` or `max_completion_tokens`, `temperature`, `top_p`, `stop`, `seed`, `stream`,
`stream_options.include_usage`) and llama.cpp's extensions (`top_k`, `min_p`, `repeat_penalty`,
`repeat_last_n`, `n_predict`, `ignore_eos`). Unknown fields are ignored, as both servers do
(clients send many); a known field of the wrong type or out of range, or a feature this server
does not have (n > 1, logprobs, tools, a JSON response format, penalties other than 0), is an
`ApiError` (HTTP 400) naming the field. Absent parameters take the runtime's defaults, which are
llama.cpp's (pyruntime.options); max_tokens absent: until a stop or the end of the context.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyruntime.options import DEFAULTS

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = (
            message, status, param, code, kind,
        )  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass
class Request:
    """One generation a client asked for."""

    kind: str  # "chat" or "text"
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | list[int] | None = None  # text completion
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # Model.generate's keywords
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


# ---- field checks -------------------------------------------------------------------------------


def _number(body: Mapping[str, Any], name: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float | None:  # fmt: skip
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(f"'{name}' must be a number, got {_shown(value)}", param=name)
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and value > hi
    ):
        low = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}"
        raise ApiError(f"'{name}' must be in {low}, {hi if hi is not None else 'inf'}], got "
                       f"{value}", param=name)  # fmt: skip
    return float(value)


def _integer(body: Mapping[str, Any], name: str, lo: int | None = None,
             hi: int | None = None) -> int | None:  # fmt: skip
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{name}' must be an integer, got {_shown(value)}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        raise ApiError(f"'{name}' must be in [{lo}, {hi}), got {value}", param=name)
    return value


def _boolean(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise ApiError(f"'{name}' must be true or false, got {_shown(value)}", param=name)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unsupported(body: Mapping[str, Any]) -> None:
    """400 for features asked for that this server does not have (their neutral values pass)."""
    n = _integer(body, "n", 1, 1 << 31)
    if n not in (None, 1):
        raise ApiError("'n' must be 1 (one choice per request)", param="n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise ApiError("logprobs are not supported", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value not in (None, 0.0):
            raise ApiError(f"'{name}' is not supported (only 0); use repeat_penalty", param=name)
    if body.get("tools") or body.get("functions"):
        raise ApiError("tools are not supported", param="tools")
    if body.get("logit_bias"):
        raise ApiError("'logit_bias' is not supported", param="logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
        raise ApiError('\'response_format\' must be {"type": "text"}', param="response_format")
    if body.get("best_of") not in (None, 1):
        raise ApiError("'best_of' must be 1", param="best_of")
    if body.get("echo") not in (None, False):
        raise ApiError("'echo' is not supported", param="echo")
    if body.get("suffix") not in (None, ""):
        raise ApiError("'suffix' is not supported", param="suffix")


def _common(body: Mapping[str, Any], req: Request) -> Request:
    """The generation parameters every endpoint takes."""
    if not isinstance(body.get("model", ""), str):
        raise ApiError("'model' must be a string", param="model")
    _unsupported(body)
    req.stream = bool(_boolean(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, Mapping):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        req.include_usage = bool(_boolean(options, "include_usage"))
    max_tokens = _integer(body, "max_completion_tokens", 0, 1 << 31)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 0, 1 << 31)
    if max_tokens is None:
        n_predict = _integer(body, "n_predict", -1, 1 << 31)  # llama.cpp: -1 = no limit
        max_tokens = None if n_predict in (None, -1) else n_predict
    req.max_tokens = max_tokens
    seed = _integer(body, "seed", -1, 1 << 64)
    values = {
        "temp": _number(body, "temperature", 0.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, lo_open=True),
        "top_k": _integer(body, "top_k", 0, 1 << 31),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "repeat_penalty": _number(body, "repeat_penalty", 0.0, lo_open=True),
        "repeat_last_n": _integer(body, "repeat_last_n", -1, 1 << 31),
        "seed": None if seed == -1 else seed,  # llama.cpp: -1 = a random seed
    }
    req.sampling = {k: v for k, v in values.items() if v is not None}
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
    ):
        raise ApiError("'stop' must be a string or a list of strings", param="stop")
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' holds more than {MAX_STOP_STRINGS} strings", param="stop")
    req.stop = [s for s in stop or [] if s]
    req.ignore_eos = bool(_boolean(body, "ignore_eos"))
    return req


def _content(message: Mapping[str, Any], i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts of type "text"."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ApiError(f"messages[{i}].content: only text parts are supported",
                               param="messages")  # fmt: skip
            if not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content: a text part needs a string 'text'",
                               param="messages")  # fmt: skip
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts",
                   param="messages")  # fmt: skip


def parse_chat(body: Any) -> Request:
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'",
                           param="messages")  # fmt: skip
        out.append({"role": m["role"], "content": _content(m, i)})
    return _common(body, Request("chat", messages=out))


def parse_completion(body: Any) -> Request:
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
    if not (isinstance(prompt, str) or (ids and prompt)):
        raise ApiError("'prompt' must be a string or a non-empty list of token ids (one prompt "
                       "per request)", param="prompt")  # fmt: skip
    return _common(body, Request("text", prompt=prompt))


# ---- responses ----------------------------------------------------------------------------------


@dataclass
class Completion:
    """What a finished (or cancelled) generation reports."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}  # fmt: skip


class Responses:
    """The response objects of one request (one id and creation time for all its chunks)."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def whole(self, c: Completion) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                      "finish_reason": c.finish_reason, "logprobs": None}  # fmt: skip
            out = self._object("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                      "logprobs": None}  # fmt: skip
            out = self._object("text_completion", [choice])
        out["usage"] = c.usage()
        return out

    def chunk(self, piece: str | None, finish_reason: str | None = None,
              first: bool = False) -> dict[str, Any]:  # fmt: skip
        """A streamed chunk: the role first (chat), then text pieces, then the finish reason."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if piece:
                delta["content"] = piece
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": None}  # fmt: skip
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": piece or "", "finish_reason": finish_reason,
                  "logprobs": None}  # fmt: skip
        return self._object("text_completion", [choice])

    def usage_chunk(self, c: Completion) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._object(obj, [])
        out["usage"] = c.usage()
        return out


def sampling_defaults() -> dict[str, Any]:
    """The registry's (llama.cpp's) sampling defaults, for the /v1/models description."""
    return {k: getattr(DEFAULTS, k) for k in ("temp", "top_k", "top_p", "min_p")}
