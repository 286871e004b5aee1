"""Time and size limits for rendering a chat template, which comes from a model file.

jinja2's sandbox stops a template from reaching Python internals, not from spending minutes or
gigabytes: nested loops, recursive macros, `"x" * 10**9`, a string doubled in a loop. Here every
sandboxed operation checks the clock and the size of what it makes: attribute and item access,
calls (of globals, macros, methods), every filter, and the operators that grow values (`*`,
`**`, `+`, `%`); the output is counted as it streams. Sizes that can be known before a value is
built are checked before (repetition, padding widths, joins, replaces); the others right after.
So a template overruns its deadline by at most the work between two operations, and never builds
a value much past the size limit. A real chat template renders in about a millisecond.
"""

from __future__ import annotations

import functools
import math
import re
import string
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0
MAX_ITEMS = 1 << 24  # characters of any string (or items of a list) a template makes, and output
MAX_INT_BITS = 1 << 16  # integers a template computes with (a 20,000-digit number)

_deadline: ContextVar[float] = ContextVar("chat_template_deadline", default=math.inf)
_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?")


class TemplateLimitError(Exception):
    """A rendering went past a limit (the message says which)."""


def _tick() -> None:
    if time.monotonic() > _deadline.get():
        raise TemplateLimitError(f"took longer than {RENDER_SECONDS:g} s")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _sized(value: Any) -> Any:
    if _size(value) > MAX_ITEMS:
        raise TemplateLimitError(f"made a value of {_size(value)} items (limit {MAX_ITEMS})")
    return value


def _number(n: Any, what: str) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_ITEMS:
        raise TemplateLimitError(f"used {what} {n} (limit {MAX_ITEMS})")


def _format_widths(fmt: str) -> None:
    """Padding widths and precisions written in a str.format or % format string."""
    try:
        specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(fmt)]
    except ValueError:
        specs = []
    numbers = [int(n) for spec in specs for n in re.findall(r"\d+", spec)]
    numbers += [int(n) for m in _PERCENT_WIDTH.finditer(fmt) for n in m.groups() if n]
    for n in numbers:
        _number(n, "a format width")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, _SIZED) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
                raise TemplateLimitError(f"repeated a value {n} times (limit {MAX_ITEMS} items)")
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError("multiplied integers past the size limit")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right > 0 and right * left.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"raised an integer to the power {right}")
    elif op == "+" and _size(left) + _size(right) > MAX_ITEMS:
        raise TemplateLimitError(f"concatenated values past {MAX_ITEMS} items")
    elif op == "%" and isinstance(left, str):
        _format_widths(left)


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Every call's arguments within the size limit; for str methods and the globals that make
    sized values, their width and count arguments and the size of a join or a replace, before
    the value is built."""
    for a in (*args, *kwargs.values()):  # a macro recursing on a doubled string, say
        _sized(a)
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if isinstance(owner, str) or name in ("generate_lorem_ipsum", "safe_range"):
        for a in (*args, *kwargs.values()):
            _number(a, "a size argument")
    if isinstance(owner, str):
        if name in ("format", "format_map"):
            _format_widths(owner)
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            total = sum(_size(x) for x in args[0]) + len(owner) * len(args[0])
            _sized_total(total, "joined")
        elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
            _sized_total(len(owner) + (len(owner) + 1) * len(args[1]), "replaced into")


def _sized_total(total: int, what: str) -> None:
    if total > MAX_ITEMS:
        raise TemplateLimitError(f"{what} a string of {total} characters (limit {MAX_ITEMS})")


def _limited_filter(f: Callable) -> Callable:
    """A jinja filter with the checks: its arguments after the filtered value (widths, counts),
    a join's or a format's size first, its result after."""
    first = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # context, then value

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def run(*args: Any, **kwargs: Any) -> Any:
        _tick()
        value, rest = (args[first], args[first + 1 :]) if len(args) > first else (None, ())
        for a in (*rest, *kwargs.values()):
            _number(a, "a size argument")
        if f.__name__ == "do_join" and isinstance(value, (list, tuple)):
            _sized_total(sum(_size(x) for x in value), "joined")
        elif f.__name__ == "do_format" and isinstance(value, str):
            _format_widths(value)
        return _sized(f(*args, **kwargs))

    return run


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the checks of the module doc in every operation."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {name: _limited_filter(f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        _check_call(__obj, args, kwargs)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return _sized(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return _sized(super().getitem(obj, argument))


def render_limited(template: Any, **variables: Any) -> str:
    """Render a template of a LimitedSandbox within the limits: TemplateLimitError when one is
    passed (a template that recurses past Python's stack or exhausts memory included)."""
    token = _deadline.set(time.monotonic() + RENDER_SECONDS)
    pieces: list[str] = []
    total = 0
    try:
        stream: Iterator[str] = template.generate(**variables)
        for piece in stream:
            total += len(piece)
            if total > MAX_ITEMS:
                raise TemplateLimitError(f"wrote more than {MAX_ITEMS} characters")
            pieces.append(piece)
            _tick()
        return "".join(pieces)
    except RecursionError:
        raise TemplateLimitError("recursed too deeply") from None
    except MemoryError:
        raise TemplateLimitError("ran out of memory") from None
    finally:
        _deadline.reset(token)
