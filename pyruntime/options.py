"""Every runtime option in one table: its keyword, CLI flags, environment variable, default, help.

One table, two doors (as llama.cpp's common_arg does): the CLI builds its flags from it
(`add_arguments`) and `pyruntime.Model` / the generation calls take their defaults from it
(`value`, `DEFAULTS`). An option with an environment variable takes its default from it when set;
a flag or keyword always wins. Command-specific arguments (a prompt, a file, bench's -p/-n) stay
with their command in cli.py; what changes how the runtime loads or decodes a model lives here.

This module imports nothing heavy (no torch), so `pyruntime --help` stays instant.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyruntime.errors import UsageError

# The commands that load a model for decoding, and those that also sample.
DECODING = ("chat", "generate", "perplexity", "bench")
SAMPLING = ("chat", "generate")


@dataclass(frozen=True)
class Option:
    name: str  # keyword of pyruntime.Model / Model.generate, and the argparse dest
    default: Any
    help: str
    flags: tuple[str, ...] = ()  # CLI flags; () = not on the command line
    commands: tuple[str, ...] = ()  # CLI commands that take the flags
    env: str | None = None  # environment variable that supplies the default when set
    parse: Callable[[str], Any] = str  # a CLI or environment string -> the value
    group: str = "runtime"  # runtime (how the model loads), decoding, sampling, paths
    metavar: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other add_argument keywords


OPTIONS: tuple[Option, ...] = (
    # -- runtime: how a model is loaded and run (pyruntime.Model keywords) ----------------------
    Option(
        "device", "auto", "auto (the GPU when there is one and the model + KV cache fit), cpu, "
        "cuda or cuda:N", ("--device",), DECODING, metavar="D",
    ),
    Option(
        "threads", None, "CPU threads (default: physical cores)", ("-t", "--threads"),
        DECODING + ("calibrate",), parse=int,
    ),
    Option(
        "n_ctx", 2048, "context size in tokens", ("-c", "--ctx-size"), SAMPLING, parse=int,
    ),
    Option(
        "sparsity", 0.0, "skip this fraction of routed-expert neurons, in [0, 1) (needs "
        "`pyruntime calibrate` first; 0 = dense). The achieved sparsity is reported on stderr.",
        ("--sparsity",), DECODING, parse=float, metavar="S",
    ),
    Option(
        "expert_backend", "auto", "CPU routed experts: auto (the C core when it is built), c, or "
        "torch (the plain reference)",
    ),
    Option(
        "kernel_tuning", None, "JSON file of GPU kernel launch configs measured on this GPU "
        "(written by bench/gpu_kernels.py; default: the built-in tables)", ("--kernel-tuning",),
        DECODING, env="PYRUNTIME_DECODE_TUNING", metavar="PATH",
    ),
    # -- decoding: how each token is computed (Model keywords; per call too) --------------------
    Option(
        "experts_per_token", None, "routed experts per token, overriding the model's top-k "
        "(default: the model's; little-only decoding is half of it)", ("--experts-per-token",),
        DECODING, parse=int, group="decoding", metavar="K",
    ),
    Option(
        "little_experts", 0, "big/little decoding: experts per token of the little pass (0 = "
        "off)", ("--little-experts",), DECODING, parse=int, group="decoding", metavar="N",
    ),
    Option(
        "big_little", False, "big/little decoding with a little pass of half the experts",
        ("--big-little",), DECODING, parse=bool, group="decoding",
        extra={"action": "store_true"},
    ),
    Option(
        "fallback_threshold", 0.7, "big/little: redo a token with all experts when the little "
        "pass's top probability is under this (0 = never, 1 = always)",
        ("--fallback-threshold",), DECODING, parse=float, group="decoding", metavar="G",
    ),
    Option(
        "fallback", "lossy", "big/little: lossy (redo unsure tokens big) or verify (the big "
        "pass checks the little pass's drafts: big-only output, exactly)", ("--fallback",),
        DECODING, group="decoding", extra={"choices": ["lossy", "verify"]},
    ),
    Option(
        "draft", 4, "big/little verify: tokens drafted per round", ("--draft",), DECODING,
        parse=int, group="decoding", metavar="N",
    ),
    # -- sampling: per generation call (llama.cpp's names and defaults) ------------------------
    Option(
        "max_tokens", 256, "tokens to generate", ("-n", "--max-tokens"), SAMPLING, parse=int,
        group="sampling",
    ),
    Option(
        "temp", 0.8, "temperature, 0 = greedy", ("--temp",), SAMPLING, parse=float,
        group="sampling",
    ),
    Option("top_k", 40, "top-k, 0 = off", ("--top-k",), SAMPLING, parse=int, group="sampling"),
    Option(
        "top_p", 0.95, "top-p, 1 = off", ("--top-p",), SAMPLING, parse=float, group="sampling"
    ),
    Option(
        "min_p", 0.05, "min-p, 0 = off", ("--min-p",), SAMPLING, parse=float, group="sampling"
    ),
    Option(
        "repeat_penalty", 1.0, "repetition penalty, 1 = off", ("--repeat-penalty",), SAMPLING,
        parse=float, group="sampling",
    ),
    Option(
        "repeat_last_n", 64, "tokens the penalty looks back, 0 = off, -1 = all",
        ("--repeat-last-n",), SAMPLING, parse=int, group="sampling",
    ),
    Option(
        "seed", None, "RNG seed (default: random)", ("--seed",), SAMPLING, parse=int,
        group="sampling",
    ),
    Option(
        "stop", (), "stop strings (never printed)", ("--stop",), SAMPLING, group="sampling",
        metavar="S", extra={"nargs": "+"},
    ),
    # -- paths: where pyruntime finds and keeps files -------------------------------------------
    Option(
        "cache_dir", None, "folder for derived files (the converted demo model, GPU kernel "
        "profiles); default $XDG_CACHE_HOME/pyruntime or ~/.cache/pyruntime",
        env="PYRUNTIME_CACHE", group="paths",
    ),
    Option(
        "core_lib", None, "the C core library to load instead of the one built with the package "
        "(development and tests)", env="PYRUNTIME_CORE_LIB", group="paths",
    ),
)  # fmt: skip

_BY_NAME = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    return _BY_NAME[name]


def value(name: str, given: Any = None) -> Any:
    """`given` when not None, else the option's environment variable when set (parsed), else
    its default."""
    if given is not None:
        return given
    opt = _BY_NAME[name]
    raw = os.environ.get(opt.env) if opt.env else None
    if raw:
        try:
            return opt.parse(raw)
        except ValueError:
            raise UsageError(f"{opt.env}={raw!r} is not a valid {name}") from None
    return opt.default


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add every option that `command` takes to its parser, in groups. Options with an
    environment variable parse to None when not given, so `value` still sees the variable."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    titles = {
        "decoding": "decoding (experts per token, big/little)",
        "sampling": "sampling (llama.cpp names and defaults)",
    }
    for opt in OPTIONS:
        if command not in opt.commands or not opt.flags:
            continue
        if opt.group not in groups:
            title = titles.get(opt.group)
            groups[opt.group] = parser.add_argument_group(title) if title else parser
        shown = f" ({opt.default})" if opt.default not in (None, (), "", False) else ""
        env = f" [env {opt.env}]" if opt.env else ""
        kwargs: dict[str, Any] = dict(opt.extra)
        if "action" not in kwargs:
            kwargs["metavar"] = opt.metavar or {int: "N", float: "X"}.get(opt.parse)
        if opt.parse is not str and "action" not in kwargs:
            kwargs["type"] = opt.parse
        groups[opt.group].add_argument(
            *opt.flags,
            dest=opt.name,
            default=None if opt.env else _arg_default(opt),
            help=f"{opt.help}{shown}{env}",
            **kwargs,
        )


def cache_dir() -> Path:
    """The folder for derived files: $PYRUNTIME_CACHE, else $XDG_CACHE_HOME/pyruntime, else
    ~/.cache/pyruntime."""
    if value("cache_dir"):
        return Path(value("cache_dir")).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "pyruntime"
    return Path.home() / ".cache" / "pyruntime"


def _arg_default(opt: Option) -> Any:
    return list(opt.default) if isinstance(opt.default, tuple) else opt.default


def from_args(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """{name: value} of the named options from parsed arguments (absent ones: `value`)."""
    return {n: value(n, getattr(args, n, None)) for n in names}


@dataclass(frozen=True)
class _Defaults:
    """Attribute access to the registry's defaults, for signatures: DEFAULTS.temp."""

    def __getattr__(self, name: str) -> Any:
        try:
            return _BY_NAME[name].default
        except KeyError:
            raise AttributeError(name) from None


DEFAULTS = _Defaults()
