"""Every runtime option in one table: its keyword, CLI flags, environment variable, default, help.

One table, two doors (as llama.cpp's common_arg does): the CLI builds its flags from it
(`add_arguments`) and `pyruntime.Model` / the generation calls take their defaults from it
(`value`, `DEFAULTS`). An option with an environment variable takes its default from it when set;
a flag or keyword always wins. Command-specific arguments (a prompt, a file, bench's -p/-n) stay
with their command in pyruntime/cli/; what changes how the runtime loads or decodes a model lives
here.

This module imports nothing heavy (no torch), so `pyruntime --help` stays instant.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import re
import stat
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyruntime.errors import PyruntimeWarning, UsageError
from pyruntime.output_files import check_writable

# How the hybrid stages experts to the GPU (pyruntime.offload.home); auto picks register.
STAGING = ("auto", "register", "bounce", "pinned")
# The commands that load a model for decoding, and those that also sample.
DECODING = ("chat", "generate", "perplexity", "bench", "serve")
SAMPLING = ("chat", "generate")


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take (floats: finite ones only)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False  # hi itself excluded
    integer: bool = False  # ints only (a count): 100.5 tokens is not a context size

    def kind_of(self, v: object) -> bool:
        """Whether v is a number of this range's kind (numpy's too; bool is not a number here)."""
        number = numbers.Integral if self.integer else numbers.Real
        return isinstance(v, number) and not isinstance(v, bool)

    def __contains__(self, v: object) -> bool:
        if not self.kind_of(v):
            return False
        if not isinstance(v, numbers.Integral) and not math.isfinite(v):  # ints: any size
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return self.hi is None or v < self.hi or (not self.hi_open and v == self.hi)

    def __str__(self) -> str:
        lo, hi = _shown(self.lo), _shown(self.hi)
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        return f"{'<' if self.hi_open else '<='} {hi}"


def _shown(x: float | None) -> str:
    """2^64 rather than 18446744073709551616."""
    if isinstance(x, int) and x >= 1 << 20 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return str(x)


C_INT = 1 << 31  # counts the C core takes as an int stay below it


def _ints(lo: int, hi: int = C_INT) -> Range:
    return Range(lo, hi, hi_open=True, integer=True)


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
    bounds: Range | None = None  # the values a numeric option may take


_SIZE = re.compile(r"(\d+\.?\d*|\.\d+)\s*([kmgt]?)(i?b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of a size written as 12G, 8GiB, 512M, 1.5g or a plain number of bytes (binary
    units: G = GiB, as nvidia-smi and llama.cpp count GPU memory)."""
    m = _SIZE.fullmatch(str(text).strip())
    if m is None or (m.group(3) and not m.group(2) and m.group(3).lower() == "ib"):
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (use e.g. 12G, 8GiB, 512M)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


OPTIONS: tuple[Option, ...] = (
    # -- runtime: how a model is loaded and run (pyruntime.Model keywords) ----------------------
    Option(
        "device", "auto", "auto (the GPU when there is one and the model + KV cache fit), cpu, "
        "cuda or cuda:N", ("--device",), DECODING, metavar="D",
    ),
    Option(
        "threads", None, "CPU threads (default: physical cores; more than the CPUs this process "
        "may use are capped to them, with a warning)", ("-t", "--threads"),
        DECODING + ("calibrate",), parse=int, bounds=_ints(1),
    ),
    Option(
        "ubatch", None, "CPU prefill: prompt tokens per chunk, each chunk through every layer "
        "together (default: the C core's, chosen by measurement); memory grows with it, not "
        "with the prompt", ("--ubatch",), DECODING, parse=int, metavar="N", bounds=_ints(1),
    ),
    Option(
        "n_ctx", 2048, "context size in tokens (0 = the model's trained context)",
        ("-c", "--ctx-size"), SAMPLING + ("info", "serve"), parse=int, bounds=_ints(0),
    ),
    Option(
        "sparsity", 0.0, "skip this fraction of routed-expert neurons, in [0, 1) (needs "
        "`pyruntime calibrate` first; 0 = dense). The achieved sparsity is reported on stderr.",
        ("--sparsity",), DECODING, parse=float, metavar="S", bounds=Range(0.0, 1.0, hi_open=True),
    ),
    Option(
        "sparsity_table", None, "the calibration table --sparsity uses (default: "
        "MODEL.sparsity.json beside the model, where `calibrate` writes it without --out)",
        ("--sparsity-table",), DECODING, metavar="FILE",
    ),
    Option(
        "gate_copy", "auto", "CPU sparse decode: a copy of the routed experts' gate rows, each "
        "expert's contiguous (a third of their bytes, in RAM), which the sparse kernel's gate "
        "pass streams instead of every third row of the model file: on, off, or auto (when "
        "--sparsity is on and the copy fits in the RAM available beside the model; a warning "
        "when it does not)", ("--gate-copy",), DECODING, extra={"choices": ["auto", "on", "off"]},
    ),
    Option(
        "weights_copy", False, "read the model file into RAM on 2 MiB pages at load instead of "
        "mapping it (costs RSS the file's size beside the page cache, ~1 s a GB): the CPU "
        "decode's weight stream then overlaps its kernels (4 KiB pages' walks keep them apart; "
        "granite-1b-a400m, 1 thread: 1.09-1.17x)", ("--weights-copy",), DECODING, parse=bool,
        extra={"action": "store_true"},
    ),
    Option(
        "expert_backend", "auto", "CPU routed experts: auto (the C core when it is built), c, or "
        "torch (the plain reference)",
    ),
    Option(
        "gpu_mem", None, "GPU memory budget, e.g. 12G, 8GiB, 512M (default: what torch can "
        "allocate on the GPU now, minus 512 MiB). A model bigger than the budget runs hybrid: "
        "dense weights and the KV cache on the GPU, the routed experts in host memory, the rest "
        "of the budget a GPU cache of expert slots", ("--gpu-mem",), DECODING + ("info",),
        parse=parse_size, group="offload", metavar="SIZE", bounds=Range(0),
    ),
    Option(
        "staging", "auto", "hybrid: how experts reach the GPU slots: register (the mapped file "
        "registered read-only with the driver, copied by DMA), bounce (the CPU copies them "
        "into small pinned buffers first), pinned (a pinned copy of every routed expert in RAM, "
        "as --pin-experts); auto: register. A refused pin falls back to bounce, with a warning",
        ("--staging",), DECODING, group="offload", extra={"choices": list(STAGING)},
    ),
    Option(
        "pin_experts", False, "hybrid: copy every routed expert into pinned RAM at load (the "
        "fastest staging; costs RAM the size of the experts): --staging pinned",
        ("--pin-experts",), DECODING, parse=bool, group="offload",
        extra={"action": "store_true"},
    ),
    Option(
        "cache_policy", "lfru", "hybrid: which cached expert a new one replaces: lfru "
        "(frequency-weighted LRU) or lru", ("--cache-policy",), DECODING, group="offload",
        extra={"choices": ["lfru", "lru"]},
    ),
    Option(
        "misses", "auto", "hybrid: where an expert that is not in a GPU slot is computed: auto "
        "(staged into the slots where they cache; with no slots or transit slots, decode steps "
        "as direct, and a prompt's misses split between the CPU and staging by costs measured "
        "on this machine), cpu, stage, or direct (a decode step is one graph: the GPU reads part "
        "of each layer's misses in place from host memory while the CPU computes the rest)",
        ("--misses",), DECODING, group="offload",
        extra={"choices": ["auto", "cpu", "stage", "direct"]},
    ),
    Option(
        "lookahead", False, "hybrid: stage the next layer's likely experts early (its router "
        "applied to this layer's hidden state)", ("--lookahead",), DECODING, parse=bool,
        group="offload", extra={"action": "store_true"},
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
        DECODING, parse=int, group="decoding", metavar="K", bounds=_ints(1),
    ),
    Option(
        "little_experts", 0, "big/little decoding: experts per token of the little pass (0 = "
        "off)", ("--little-experts",), DECODING, parse=int, group="decoding", metavar="N",
        bounds=_ints(0),
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
        bounds=Range(0.0, 1.0),
    ),
    Option(
        "fallback", "lossy", "big/little: lossy (redo unsure tokens big) or verify (the big "
        "pass checks the little pass's drafts: big-only output, exactly)", ("--fallback",),
        DECODING, group="decoding", extra={"choices": ["lossy", "verify"]},
    ),
    Option(
        "draft", 4, "big/little verify: tokens drafted per round", ("--draft",), DECODING,
        parse=int, group="decoding", metavar="N", bounds=_ints(1),
    ),
    Option(
        "draft_experts", "little", "big/little verify: the draft's experts: little (the top "
        "--little-experts) or resident (hybrid only: those of the top-K already in GPU slots; "
        "no bytes staged, no CPU work)", ("--draft-experts",), DECODING, group="decoding",
        extra={"choices": ["little", "resident"]},
    ),
    # -- sampling: per generation call (llama.cpp's names and defaults) ------------------------
    Option(
        "max_tokens", 256, "tokens to generate (-1: until a stop or a full context, as "
        "llama.cpp's -n -1)", ("-n", "--max-tokens"), SAMPLING, parse=int, group="sampling",
        bounds=_ints(-1),
    ),
    Option(
        "temp", 0.8, "temperature, 0 = greedy", ("--temp",), SAMPLING, parse=float,
        group="sampling", bounds=Range(0.0),
    ),
    Option(
        "top_k", 40, "top-k, 0 = off", ("--top-k",), SAMPLING, parse=int, group="sampling",
        bounds=_ints(0),
    ),
    Option(
        "top_p", 0.95, "top-p, 1 = off", ("--top-p",), SAMPLING, parse=float, group="sampling",
        bounds=Range(0.0, 1.0, lo_open=True),
    ),
    Option(
        "min_p", 0.05, "min-p, 0 = off", ("--min-p",), SAMPLING, parse=float, group="sampling",
        bounds=Range(0.0, 1.0),
    ),
    Option(
        "repeat_penalty", 1.0, "repetition penalty, 1 = off", ("--repeat-penalty",), SAMPLING,
        parse=float, group="sampling", bounds=Range(0.0, lo_open=True),
    ),
    Option(
        "repeat_last_n", 64, "tokens the penalty looks back, 0 = off, -1 = all",
        ("--repeat-last-n",), SAMPLING, parse=int, group="sampling", bounds=_ints(-1),
    ),
    Option(
        "seed", None, "RNG seed (default, or -1 as llama.cpp's: random)", ("--seed",), SAMPLING,
        parse=int, group="sampling", bounds=Range(-1, 1 << 64, hi_open=True, integer=True),
    ),
    Option(
        "stop", (), "a stop string (never printed); --stop again for another",
        ("--stop",), SAMPLING, group="sampling", metavar="S", extra={"action": "append"},
    ),
    # -- server: where `pyruntime serve` listens ------------------------------------------------
    Option(
        "host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)", ("--host",),
        ("serve",), env="PYRUNTIME_HOST", group="server", metavar="ADDR",
    ),
    Option(
        "port", 8080, "port to listen on", ("--port",), ("serve",), env="PYRUNTIME_PORT",
        parse=int, group="server", bounds=_ints(1, 1 << 16),
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
        except (ValueError, argparse.ArgumentTypeError):
            raise UsageError(f"{opt.env}={raw!r} is not a valid {name}") from None
    return opt.default


def check(name: str, v: Any, flag: bool = False) -> None:
    """UsageError when `v` (not None) is outside option `name`'s range, naming the option as a
    keyword, or as its CLI flag when `flag`."""
    opt = _BY_NAME[name]
    if v is not None and opt.bounds is not None and v not in opt.bounds:
        shown = opt.flags[-1] if flag and opt.flags else name
        if not opt.bounds.kind_of(v):  # "2048" or 100.5 for a count: say what it must be
            kind = "an int" if opt.bounds.integer else "a number"
            raise UsageError(f"{shown} must be {kind} {opt.bounds}, got {v!r}")
        raise UsageError(f"{shown} must be {opt.bounds}, got {v}")


def check_kind(name: str, v: Any, what: str = "", optional: bool = True) -> None:
    """UsageError when `v` is not a number of option `name`'s kind (an int for a count), before
    any comparison would raise a bare TypeError; None passes when `optional`; `what` prefixes
    the message."""
    bounds = _BY_NAME[name].bounds
    if (v is not None or not optional) and bounds is not None and not bounds.kind_of(v):
        kind = "an int" if bounds.integer else "a number"
        raise UsageError(f"{what}{name} must be {kind}, got {v!r}")


# Options that only big/little decoding reads: given without it, they would do nothing.
BIG_LITTLE_ONLY = ("fallback_threshold", "fallback", "draft", "draft_experts")


def check_args(args: argparse.Namespace) -> None:
    """Every option parsed into `args` in its range, and none given that would be ignored
    (before anything is loaded)."""
    for opt in OPTIONS:
        check(opt.name, getattr(args, opt.name, None), flag=True)
    if hasattr(args, "big_little") and not args.big_little and not args.little_experts:
        for name in BIG_LITTLE_ONLY:
            opt = _BY_NAME[name]
            if getattr(args, name, opt.default) != opt.default:
                raise UsageError(f"{opt.flags[-1]} is for big/little decoding: add --big-little "
                                 "(or --little-experts N)")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add every option that `command` takes to its parser, in groups. Options with an
    environment variable parse to None when not given, so `value` still sees the variable."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    titles = {
        "decoding": "decoding (experts per token, big/little)",
        "sampling": "sampling (llama.cpp names and defaults)",
        "offload": "offload (a model bigger than the GPU)",
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
        takes_value = kwargs.get("action", "store") in ("store", "append")
        if takes_value:
            kwargs["metavar"] = opt.metavar or {int: "N", float: "X"}.get(opt.parse)
        if opt.parse is not str and takes_value:
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


def writable_cache_dir() -> Path:
    """cache_dir(), created; when it cannot be created or written (a read-only
    $PYRUNTIME_CACHE), a private folder in the system's temp dir instead, with a warning."""
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        check_writable(path)
        return path
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if path.exists() and not path.is_dir():
            reason = "it is a file, not a folder"
    fallback = _private_temp_dir()
    warnings.warn(
        f"the cache folder {path} is not writable ({reason}); using {fallback} instead (set "
        "PYRUNTIME_CACHE to a writable folder)",
        PyruntimeWarning,
        stacklevel=2,
    )
    return fallback


def _private_temp_dir() -> Path:
    """A folder only this user can use in the system's temp dir: pyruntime-<uid> when it is this
    user's own and private (then it lasts across runs), else a fresh one for this process (a
    name in a shared temp dir may have been planted by someone else)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    path = Path(tempfile.gettempdir()) / f"pyruntime-{uid if uid is not None else 'user'}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
        ours = uid is None or st.st_uid == uid
        if stat.S_ISDIR(st.st_mode) and ours and not st.st_mode & 0o077:
            check_writable(path)
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="pyruntime-"))


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
