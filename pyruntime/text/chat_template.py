"""Render the chat template stored in the GGUF (`tokenizer.chat_template`) with jinja2.

The environment mirrors transformers' `apply_chat_template`: a sandbox (templates come from model
files, which are untrusted), `trim_blocks`/`lstrip_blocks`, `raise_exception`, a `tojson` that
keeps non-ASCII, `strftime_now`, and the variables `messages`, `bos_token`, `eos_token`,
`add_generation_prompt`. Rendering has a time and a size limit (template_limits.py); any failure
is one ChatTemplateError line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2

from pyruntime.errors import ModelFileError, UsageError
from pyruntime.text.template_limits import LimitedSandbox, TemplateLimitError, render_limited

_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's (harmony)


class ChatTemplateError(UsageError):
    """The template refused the messages (its `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check the OpenAI-style message list; returns plain dicts. UsageError names the bad entry."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise UsageError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise UsageError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if message["role"] not in _ROLES:
            raise UsageError(
                f"messages[{i}]: unknown role {message['role']!r}; use one of {', '.join(_ROLES)}"
            )
        if "content" not in message:  # the template would fail on it, naming a jinja attribute
            raise UsageError(f"messages[{i}] has no 'content'")
        if not isinstance(message["content"], str):
            raise UsageError(f"messages[{i}]: 'content' must be a string")
        out.append(dict(message))
    return out


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    source: str = "model",
) -> str:
    """The prompt text for `messages`; `source` names the model file in error messages."""
    if not template:
        raise ModelFileError(
            f"{source}: the GGUF has no chat template (tokenizer.chat_template); use "
            "`generate` with a plain prompt, or convert a checkpoint that ships a chat template"
        )
    messages = validate_messages(messages)
    try:
        return render_limited(
            _compile(template),
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except ChatTemplateError:
        raise
    except TemplateLimitError as exc:
        raise ChatTemplateError(f"{source}: the chat template {exc}; refused") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"{source}: chat template failed to render: {exc}") from None
    except (RecursionError, MemoryError):
        raise ChatTemplateError(f"{source}: the chat template is too large to compile") from None
    except Exception as exc:  # the template's own arithmetic or calls: 1/0, int("x"), ...
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise ChatTemplateError(
            f"{source}: chat template failed to render: {type(exc).__name__}: {reason}"
        ) from None
