"""Input a careless user or a hostile file gives (issue 20): bytes that are not UTF-8, hostile
chat templates, out-of-range numbers, bytes as a prompt, a prompt past the trained context,
Ctrl-C in `generate`; one `-c/--ctx-size` spelling."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from hf_fixtures import make_tiny_hf_model

from pyruntime import cli
from pyruntime.api import Model
from pyruntime.converter import convert
from pyruntime.decoding.sampling import SamplingParams
from pyruntime.decoding.stream import TextStream
from pyruntime.errors import PyruntimeWarning, UsageError
from pyruntime.text.chat_template import ChatTemplateError, render_chat
from pyruntime.tools.demo import demo_model_path

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "Hello."}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "pyruntime-cache"


@pytest.fixture(scope="module")
def demo(cache) -> Path:
    return demo_model_path(cache, quiet=True)


def run(args: list, cache: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYRUNTIME_CACHE=str(cache), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pyruntime", *args], input=stdin,
                          capture_output=True, env=env, cwd=REPO, timeout=300)  # fmt: skip


# ---- bytes that are not UTF-8 -----------------------------------------------------------------


def test_chat_replaces_undecodable_input_once_and_goes_on(demo, cache):
    r = run(["chat", str(demo), "-n", "4", "--temp", "0"], cache,
            stdin=b"hello \xff\xfe world\nSecond \xc3 line.\nThird.\n")  # fmt: skip
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert len(r.stdout.decode().splitlines()) == 3  # every line answered
    assert err.count("warning: the input had bytes that are not UTF-8") == 1, err
    assert "Traceback" not in err


def test_prompt_bytes_from_the_command_line(demo, cache):
    r = run(["generate", str(demo), "-p", b"caf\xe9 au lait", "-n", "3", "--temp", "0"], cache)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "warning: the prompt had bytes that are not UTF-8" in err and "Traceback" not in err


def test_the_api_refuses_bytes_and_lone_surrogates(demo):
    model = Model(demo, n_ctx=64)
    with pytest.raises(UsageError, match="the prompt is bytes"):
        model.generate(b"hello")
    with pytest.raises(UsageError, match="sequence of int token ids"):
        model.generate([1.5, 2.0])
    with pytest.raises(UsageError, match="must be a str, got bytes"):
        model.tokenize(b"hello")
    with pytest.raises(UsageError, match="lone surrogate at index 3"):
        model.tokenize("caf\udce9")
    with pytest.raises(UsageError, match="takes token ids"):
        model.logits("hello")


# ---- chat templates ---------------------------------------------------------------------------

HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "a huge string": "{{ 'x' * 1000000000 }}",
    "a doubling string": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "a recursing macro": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "a padding width": "{{ '{:>1000000000}'.format(1) }}",
    "a filter width": "{{ 'x'|center(1000000000) }}",
    "a huge join": "{{ (['x' * 1000000] * 1000)|join }}",
    "deep recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "a division by zero": "{{ 1 / 0 }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_fast_in_one_line(name):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat(HOSTILE[name], MESSAGES, source="m.gguf")
    assert time.monotonic() - t0 < 5  # the limit is 2 s
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert grown_mib < 512, grown_mib  # before: gigabytes
    message = str(info.value)
    assert message.startswith("m.gguf: ") and "\n" not in message


def test_real_templates_still_render():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content|trim }}{% endfor %}" + (
        "{{ '%-6s|' % 'end' }}{{ '{:>4}'.format(7) }}{{ (messages|map(attribute='role'))|join }}"
    )
    assert render_chat(template, MESSAGES) == "<user>Hello.end   |   7user"


# ---- numbers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seed", str(2**64)], "--seed must be in [-1, 2^64), got 18446744073709551616"),
        (["--seed", "-2"], "--seed must be in [-1, 2^64)"),
        (["--top-p", "0"], "--top-p must be in (0.0, 1.0]"),
        (["--min-p", "1.5"], "--min-p must be in [0.0, 1.0]"),
        (["--temp", "nan"], "--temp must be >= 0.0, got nan"),
        (["--repeat-penalty", "inf"], "--repeat-penalty must be > 0.0"),
        (["--repeat-last-n", "-2"], "--repeat-last-n must be in [-1, 2^31)"),
        (["-t", "0"], "--threads must be in [1, 2^31)"),
        (["-t", str(2**40)], "--threads must be in [1, 2^31)"),
        (["-c", "-1"], "--ctx-size must be in [0, 2^31)"),
        (["-n", "-5"], "--max-tokens must be in [-1, 2^31)"),
        (["--top-k", str(2**31)], "--top-k must be in [0, 2^31)"),
        (["--sparsity", "1"], "--sparsity must be in [0.0, 1.0)"),
        (["--draft", "0"], "--draft must be in [1, 2^31)"),
        (["--fallback-threshold", "-0.1"], "--fallback-threshold must be in [0.0, 1.0]"),
    ],
)
def test_every_numeric_flag_is_range_checked_before_loading(flags, message, capsys):
    argv = ["generate", "/nonexistent.gguf", "-p", "x", *flags]  # never opened: checked first
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"error: {message}\n" or (err.startswith(f"error: {message}") and
                                           err.count("\n") == 1), err  # fmt: skip


def test_command_numbers_and_the_api(capsys, demo):
    assert cli.main(["bench", "/nonexistent.gguf", "-p", str(2**31)]) == 1
    assert "in [1, 2^31)" in capsys.readouterr().err
    assert cli.main(["generate", str(demo), "-p", "x", "-n", "2", "--seed", "-1"]) == 0  # random
    with pytest.raises(UsageError, match=r"seed must be in \[-1, 2\^64\), got"):
        Model(demo, seed=2**64)
    with pytest.raises(UsageError) as info:
        SamplingParams(top_p=0.0)
    assert (
        str(info.value) == "invalid sampling parameter: top_p must be in (0, 1] (1 = off), got 0.0"
    )


def test_one_ctx_size_spelling(demo, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The Jargon File is a glossary of hacker slang. " * 20)
    assert cli.main(["perplexity", str(demo), "-f", str(text), "-c", "32", "--json"]) == 0
    assert '"ctx": 32' in capsys.readouterr().out
    assert cli.main(["perplexity", str(demo), "-f", str(text), "--ctx-size", "48", "--json"]) == 0
    assert '"ctx": 48' in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:  # info reads a file; it runs nothing
        cli.main(["info", str(demo), "-t", "4"])
    assert info.value.code == 2


# ---- the trained context, Ctrl-C -----------------------------------------------------------------


def test_a_prompt_past_the_trained_context_is_warned_about(tmp_path):
    hf = make_tiny_hf_model("olmoe", tmp_path / "hf")  # max_position_embeddings 256
    model = Model(convert(hf, tmp_path / "m.gguf", "f32", progress=False), n_ctx=400)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        "".join(model.generate(list(range(1, 200)), max_tokens=1))
        assert caught == []
        "".join(model.generate(list(range(1, 300)), max_tokens=1))
    assert [w.category for w in caught] == [PyruntimeWarning]
    assert "299 tokens, more than the 256 the model was trained on" in str(caught[0].message)


def test_ctrl_c_in_generate_prints_the_timing_line(demo, monkeypatch, capsys):
    real = TextStream.__next__
    pieces = []

    def interrupted(self):
        if len(pieces) == 3:
            raise KeyboardInterrupt
        pieces.append(real(self))
        return pieces[-1]

    monkeypatch.setattr(TextStream, "__next__", interrupted)
    argv = ["generate", str(demo), "-p", "The hacker", "-n", "20", "--temp", "0", "--ignore-eos"]
    assert cli.main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out == "".join(pieces) + "\n"
    assert captured.err.startswith("finish: interrupted | prompt: ") and "tokens/s" in captured.err
