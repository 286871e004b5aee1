"""The `pyruntime` CLI: a few end-to-end runs through subprocess (each costs a torch import),
the rest in-process through `cli.main(argv)`."""

import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyruntime import __version__, cli
from pyruntime.cli import chat as chat_command
from pyruntime.gguf.file import open_gguf
from pyruntime.tools.demo import DEMO_SOURCE, demo_model_path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The hacker wrote a program that"
TEXT = (
    "The Jargon File is a glossary of hacker slang. It was started in 1975 at Stanford and "
    "was later maintained at MIT. Hackers wrote programs, fixed bugs and argued about indent "
    "style late into the night, and the file recorded the words they used for all of it.\n"
) * 3
TEXT_TOKENS = 234  # tokens of TEXT with the demo tokenizer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "pyruntime-cache"


@pytest.fixture(scope="module")
def gguf_path(cache_dir) -> Path:
    return demo_model_path(cache_dir, quiet=True)


@pytest.fixture()
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run_cli(args: list[str], cache: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYRUNTIME_CACHE=str(cache))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pyruntime", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )


# ---------------------------------------------------------------------------------------------
# End to end (subprocess)


def test_chat_from_piped_stdin_prints_an_answer(tmp_path):
    # A fresh cache dir: the demo model is converted on first use, announced on stderr.
    cache = tmp_path / "cache"
    r = run_cli(["chat", "-n", "48"], cache, stdin="Tell me a fortune.\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "converting the demo model" in r.stderr
    assert "Traceback" not in r.stderr
    assert len(list(cache.glob("*.gguf"))) == 1
    assert not list(cache.glob(".*tmp"))


def test_generate_greedy_equals_transformers(gguf_path, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(DEMO_SOURCE, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEMO_SOURCE)
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    new: list[int] = []
    with torch.no_grad():  # greedy with transformers' own KV cache, no stop tokens
        out = hf(ids, use_cache=True)
        for _ in range(20):
            new.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([new[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    expected = tok.decode(new, skip_special_tokens=True)

    args = ["generate", str(gguf_path), "-p", PROMPT, "-n", "20", "--temp", "0", "--ignore-eos"]
    r = run_cli(args, cache_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected
    assert "tokens/s" in r.stderr


def test_perplexity_prints_ppl_last(gguf_path, cache_dir, text_file):
    r = run_cli(["perplexity", str(gguf_path), "-f", str(text_file), "--ctx", "64"], cache_dir)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("ppl = ")
    assert len(last.split(".")[-1]) == 4 and float(last[6:]) > 1
    assert "[1/" in r.stderr  # progress goes to stderr


@pytest.mark.parametrize("kind", ["missing", "not-gguf", "empty", "truncated"])
def test_bad_model_files_give_one_line_errors(kind, gguf_path, cache_dir, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    if kind == "not-gguf":
        path.write_text("this is not a model\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    r = run_cli(["info", str(path)], cache_dir)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert str(path) in lines[0]
    if kind == "empty":
        assert lines[0].endswith(": an empty file, not a GGUF file")


# ---------------------------------------------------------------------------------------------
# In-process


def test_version_and_no_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pyruntime {__version__}"
    assert cli.main([]) == 2


def test_info_describes_the_model(gguf_path, capsys):
    assert cli.main(["info", str(gguf_path)]) == 0
    out = capsys.readouterr().out
    n_params = sum(t.n_elements for t in open_gguf(gguf_path).tensors.values())
    assert f"{n_params:,}" in out
    for expected in ("olmoe", "OlmoeForCausalLM", "F32: 43", "16 (used per token: 4)", "4096"):
        assert expected in out


def test_info_does_not_load_torch_without_a_gpu(gguf_path):
    """info is a quick look: on a machine with no GPU driver it describes our own file without
    importing torch (~2 s here), and says there is no GPU for the plan."""
    from pyruntime.cli.info import _may_have_gpu

    if _may_have_gpu():
        pytest.skip("a GPU driver is here (or not Linux): info asks torch about the GPU")
    code = (
        "import sys; from pyruntime import cli; "
        f"code = cli.main(['info', {str(gguf_path)!r}]); "
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gpu plan        : no GPU here" in done.stdout
    assert done.stdout.splitlines()[-1] == "0 False"


def test_perplexity_json(gguf_path, text_file, capsys):
    argv = ["perplexity", str(gguf_path), "-f", str(text_file), "--ctx", "64", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {
        "ppl",
        "nll",
        "tokens_scored",
        "windows",
        "ctx",
        "sparsity_target",
        "sparsity_achieved",
    }
    assert result["sparsity_target"] == 0 and result["sparsity_achieved"] == 0
    assert result["ctx"] == 64 and result["windows"] == 4
    assert result["tokens_scored"] == result["windows"] * 63 - (256 - TEXT_TOKENS)
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]), rel=1e-12)


def test_perplexity_window_zero_is_the_trained_context(gguf_path, text_file, capsys):
    assert cli.main(["perplexity", str(gguf_path), "-f", str(text_file), "-c", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    trained = open_gguf(gguf_path).arch_get("context_length")
    assert trained > TEXT_TOKENS and result["ctx"] == trained and result["windows"] == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "{model}", "-p", "x", "--temp", "-1"], "temp must be >= 0"),
        (["generate", "{model}", "-f", "/nonexistent/prompt.txt"], "no such file"),
        (["perplexity", "{model}", "-f", "{text}", "--ctx", "1"], "--ctx-size must be 0 (the"),
        (["chat", "{bad}"], "not a GGUF file"),
        (["generate", "{bad}", "-p", "x"], "not a GGUF file"),
        (["calibrate", "{model}", "-f", "{text}", "--max-tokens", "0"], "--max-tokens must be in"),
        (["calibrate", "{model}", "-f", "{text}", "-c", "1"], "or >= 2 tokens, got 1"),
        (["generate", "{model}", "-p", "x", "--fallback", "verify"], "--fallback is for big/"),
        (["chat", "{model}", "--draft", "2"], "--draft is for big/little decoding"),
    ],
)
def test_user_errors_are_one_line(argv, message, gguf_path, text_file, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    argv = [a.format(model=gguf_path, text=text_file, bad=bad) for a in argv]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "{model}", "-p", "x", "--gpu-mem", "12Q"], "argument --gpu-mem: '12Q' is"),
        (["generate", "{model}", "-p", "x", "--stop"], "argument --stop: expected one argument"),
        (["bench", "{model}", "-o", "csv"], "argument -o/--output: invalid choice: 'csv'"),
        (["generate", "{model}"], "one of the arguments -p/--prompt -f/--file is required"),
        (["nonsense"], "argument COMMAND: invalid choice"),
    ],
)
def test_argument_errors_are_one_line(argv, message, gguf_path, capsys):
    """argparse's own errors too: one `error:` line naming the command, exit status 2."""
    with pytest.raises(SystemExit) as done:
        cli.main([a.format(model=gguf_path) for a in argv])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pyruntime") and err.count("\n") == 1 and message in err
    assert "usage:" not in err


def test_generate_stop_string(gguf_path, capsys):
    argv = ["generate", str(gguf_path), "-p", PROMPT, "-n", "20", "--temp", "0", "--ignore-eos"]
    assert cli.main(argv) == 0
    full = capsys.readouterr().out
    stop = full[4:7]
    assert cli.main([*argv, "--stop", stop]) == 0
    captured = capsys.readouterr()
    assert captured.out == full[: full.index(stop)]
    assert "finish: stop" in captured.err
    # --stop takes one string (--stop again for another), and one before the model path leaves
    # the path alone (it took every word after it once, the path too)
    later, rest = full[9:12], argv[2:]
    assert full.index(stop) < full.index(later)
    assert cli.main(["generate", "--stop", later, "--stop", stop, str(gguf_path), *rest]) == 0
    assert capsys.readouterr().out == full[: full.index(stop)]
    assert cli.main(["generate", "--stop", later, str(gguf_path), *rest]) == 0
    assert capsys.readouterr().out == full[: full.index(later)]


def test_prompt_and_text_from_standard_input(gguf_path, text_file, monkeypatch, capsys):
    """-f - reads standard input (the prompt of generate, the text of perplexity)."""
    argv = ["generate", str(gguf_path), "-n", "6", "--temp", "0", "--ignore-eos"]
    assert cli.main([*argv, "-p", PROMPT]) == 0
    expected = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
    assert cli.main([*argv, "-f", "-"]) == 0
    assert capsys.readouterr().out == expected
    ppl = ["perplexity", str(gguf_path), "--ctx", "64", "--json"]
    assert cli.main([*ppl, "-f", str(text_file)]) == 0
    expected = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text_file.read_bytes())))
    assert cli.main([*ppl, "-f", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    assert cli.main([*argv, "-f", "-"]) == 1
    assert capsys.readouterr().err.startswith("error: standard input: not UTF-8 text")


def test_generate_without_a_token_limit_fills_the_context(gguf_path, capsys):
    """-n -1 (llama.cpp's spelling): no limit but a stop or a full context."""
    argv = ["generate", str(gguf_path), "-p", PROMPT, "-n", "-1", "-c", "24", "--temp", "0",
            "--ignore-eos"]  # fmt: skip
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    prompt, generated = map(int, re.search(r"prompt: (\d+) tokens.*generation: (\d+) tokens",
                                           err).groups())  # fmt: skip
    assert "finish: length" in err and prompt + generated - 1 == 24, err  # the last not fed back


def test_generate_into_one_pipe_puts_the_finish_line_on_its_own(gguf_path, cache_dir):
    """stdout and stderr into one pipe (2>&1): the text, then the finish line on a new line."""
    r = subprocess.run(
        [sys.executable, "-m", "pyruntime", "generate", str(gguf_path), "-p", PROMPT, "-n", "6",
         "--temp", "0", "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
        env={**os.environ, "PYRUNTIME_CACHE": str(cache_dir)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout
    assert any(line.startswith("finish: length") for line in r.stdout.splitlines()), r.stdout


def _chat(monkeypatch, cache_dir, lines: str, *argv: str) -> int:
    monkeypatch.setenv("PYRUNTIME_CACHE", str(cache_dir))
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return cli.main(["chat", "--temp", "0", "-n", "12", *argv])


def test_chat_history_reset_and_exit(monkeypatch, gguf_path, cache_dir, capsys):
    seen: list[list[dict]] = []
    real = chat_command._stream_answer

    def spy(model, history, args, kwargs):
        seen.append([dict(m) for m in history])
        return real(model, history, args, kwargs)

    monkeypatch.setattr(chat_command, "_stream_answer", spy)
    lines = "Hello.\n\nHow are you?\n/reset\nHello.\n/exit\nnever read\n"
    assert _chat(monkeypatch, cache_dir, lines, "--system", "Be brief.") == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(seen) == 3
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[2] == seen[0]  # /reset keeps only the system prompt
    assert len(answers) >= 3 and answers[0] == answers[-1]  # greedy: same history, same answer


def test_chat_help_and_unknown_commands(monkeypatch, gguf_path, cache_dir, capsys):
    """/help lists the commands and is no message; at a terminal a mistyped /command says so
    instead of going to the model (piped, such a line stays a message: scripts send text)."""
    seen: list[str] = []
    monkeypatch.setattr(chat_command, "_stream_answer",
                        lambda model, history, args, kwargs: seen.append(history[-1]["content"])
                        or "ok")  # fmt: skip
    assert _chat(monkeypatch, cache_dir, "/help\nHello.\n/bogus\n") == 0
    assert seen == ["Hello.", "/bogus"] and "/reset clears the history" in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    seen.clear()
    monkeypatch.setattr(sys, "stdin", Terminal("/bogus\n/?\nHello.\n"))
    assert cli.main(["chat", "--temp", "0", "-n", "4"]) == 0
    err = capsys.readouterr().err
    assert seen == ["Hello."] and "unknown command /bogus: /help lists them" in err
    assert "pyruntime chat with the built-in demo model" in err and err.count("/exit quits") == 2


def test_ctrl_c_stops_the_answer_not_the_chat(monkeypatch, cache_dir, gguf_path, capsys):
    from pyruntime.api import Model

    real = Model.create_chat_completion
    calls = []

    def interrupted(self, messages, **kwargs):
        calls.append(len(messages))
        stream = real(self, messages, **kwargs)
        if len(calls) == 1:
            yield next(stream)
            yield next(stream)
            raise KeyboardInterrupt
        yield from stream

    monkeypatch.setattr(Model, "create_chat_completion", interrupted)
    assert _chat(monkeypatch, cache_dir, "First.\nSecond.\n") == 0
    captured = capsys.readouterr()
    assert "interrupted" in captured.err
    assert calls == [1, 3]  # the interrupted answer is kept in the history
    # Ctrl-C while waiting for input leaves with 130, quietly
    monkeypatch.setattr(
        chat_command,
        "_read_user_line",
        lambda interactive: (_ for _ in ()).throw(KeyboardInterrupt),
    )
    assert _chat(monkeypatch, cache_dir, "") == 130
    assert "Traceback" not in capsys.readouterr().err


def test_demo_model_is_converted_once(tmp_path, capsys):
    cache = tmp_path / "fresh"
    path = demo_model_path(cache)
    assert "converting the demo model" in capsys.readouterr().err
    mtime = path.stat().st_mtime_ns
    assert demo_model_path(cache) == path
    assert path.stat().st_mtime_ns == mtime
    assert capsys.readouterr().err == ""
    assert open_gguf(path).get("general.file_type") == 0  # f32


def test_progress_is_a_few_lines_off_a_terminal():
    from pyruntime.cli.common import PROGRESS_LINES, progress_printer

    out = io.StringIO()  # not a terminal
    show = progress_printer(out)
    for i in range(338):
        show(i + 1, 338, f" running ppl = {10.0 + i:.4f}")
    lines = out.getvalue().splitlines()
    assert PROGRESS_LINES <= len(lines) <= PROGRESS_LINES + 1
    assert lines[-1] == "[338/338] running ppl = 347.0000"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    show = progress_printer(out)
    for i in range(3):
        show(i + 1, 3)
    assert out.getvalue() == "".join(f"\r[{i}/3]" for i in (1, 2, 3)) + "\n"
