"""The option registry (pyruntime.options): one table read by the CLI and by pyruntime.Model."""

from __future__ import annotations

import inspect

import pytest

from pyruntime import options
from pyruntime.api import Model
from pyruntime.cli import build_parser
from pyruntime.decoding.sampling import SamplingParams
from pyruntime.errors import UsageError


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_every_flagged_option_is_on_its_commands():
    args = {
        "chat": ["chat"],
        "generate": ["generate", "m.gguf", "-p", "x"],
        "perplexity": ["perplexity", "m.gguf", "-f", "t.txt"],
        "bench": ["bench"],
        "calibrate": ["calibrate", "m.gguf", "-f", "t.txt"],
        "info": ["info", "m.gguf"],
        "serve": ["serve"],
    }
    for opt in options.OPTIONS:
        for command in opt.commands:
            ns = parse(*args[command])
            assert hasattr(ns, opt.name), f"{command} lacks {opt.flags}"
            expected = None if opt.env else options._arg_default(opt)
            assert getattr(ns, opt.name) == expected, (command, opt.name)


def test_runtime_options_are_model_keywords_with_the_same_defaults():
    params = inspect.signature(Model.__init__).parameters
    for opt in options.OPTIONS:
        if opt.group not in ("runtime", "decoding", "offload"):
            continue
        assert opt.name in params, f"pyruntime.Model has no keyword {opt.name}"
        default = params[opt.name].default
        assert default == opt.default or (default is None and opt.env), opt.name


def test_sampling_defaults_come_from_the_registry():
    p = SamplingParams()
    for name in ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n"):
        assert getattr(p, name) == options.option(name).default
    assert options.DEFAULTS.temp == 0.8 and options.DEFAULTS.top_k == 40  # llama.cpp's


def test_environment_supplies_the_default_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("PYRUNTIME_DECODE_TUNING", "/from/env.json")
    ns = parse("generate", "m.gguf", "-p", "x")
    assert options.from_args(ns, ["kernel_tuning"]) == {"kernel_tuning": "/from/env.json"}
    ns = parse("generate", "m.gguf", "-p", "x", "--kernel-tuning", "/flag.json")
    assert options.from_args(ns, ["kernel_tuning"]) == {"kernel_tuning": "/flag.json"}
    monkeypatch.delenv("PYRUNTIME_DECODE_TUNING")
    assert options.value("kernel_tuning") is None


def test_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.delenv("PYRUNTIME_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert options.cache_dir() == tmp_path / "xdg" / "pyruntime"
    monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path / "own"))
    assert options.cache_dir() == tmp_path / "own"


def test_a_malformed_environment_value_is_a_usage_error(monkeypatch):
    opt = options.Option("x_int", 1, "an int", env="PYRUNTIME_TEST_X", parse=int)
    monkeypatch.setitem(options._BY_NAME, "x_int", opt)
    monkeypatch.setenv("PYRUNTIME_TEST_X", "abc")
    with pytest.raises(UsageError, match="PYRUNTIME_TEST_X='abc' is not a valid x_int"):
        options.value("x_int")
